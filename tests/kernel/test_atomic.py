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


def test_a_missing_directory_is_made_and_a_bare_name_lands_in_the_working_directory(
        tmp_path, monkeypatch):
    nested = tmp_path / "a" / "b" / "model.bin"
    with atomic_file(str(nested), durable=True) as fh:  # a str path as well as a Path
        fh.write(b"deep")
    assert nested.read_bytes() == b"deep"
    monkeypatch.chdir(tmp_path)
    with atomic_file("here.bin", prefix=".x-", suffix=".part") as fh:
        fh.write(b"here")
    assert (tmp_path / "here.bin").read_bytes() == b"here"
    assert not list(tmp_path.glob(".x-*.part"))


def test_a_target_whose_directory_is_a_file_is_refused_and_leaves_nothing(tmp_path):
    (tmp_path / "out").write_text("a file, not a directory")
    with pytest.raises(OSError):
        with atomic_file(tmp_path / "out" / "model.bin") as fh:
            fh.write(b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
