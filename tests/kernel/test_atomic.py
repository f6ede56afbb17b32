"""Atomic file writes (``meshkit._atomic``): the old file or the whole new one, never part."""

from __future__ import annotations

import json

import pytest

from meshkit._atomic import atomic_file
from meshkit.train._coordinator.artifacts import write_summary


def test_the_target_is_replaced_only_when_the_block_ends(tmp_path):
    target = tmp_path / "summary.json"
    target.write_text("old")
    with atomic_file(target) as fh:
        fh.write(b"new, half")
        assert target.read_text() == "old"  # a reader mid-write sees the old file
        fh.write(b" and whole")
    assert target.read_text() == "new, half and whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_an_error_while_writing_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "model.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="disk on fire"):
        with atomic_file(target, durable=True) as fh:
            fh.write(b"partial")
            raise RuntimeError("disk on fire")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.bin"]


def test_summary_json_is_written_atomically(tmp_path):
    (tmp_path / "summary.json").write_text('{"round": 1}\n')
    write_summary(tmp_path, {"round": 2, "ok": True})
    assert json.loads((tmp_path / "summary.json").read_text()) == {"round": 2, "ok": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
