"""Checkpoints: atomic, numpy-only (never pickle), and faithful round trips."""

from __future__ import annotations

import io
import json
import os
import time

import numpy as np
import pytest

from meshkit.checkpoint import (
    STALE_TEMPORARY_SECONDS,
    Checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from meshkit.errors import ConfigError, StateError
from meshkit.state import BFLOAT16


def sample(round_: int = 3) -> Checkpoint:
    rng = np.random.default_rng(5)
    rng.random(3)
    return Checkpoint(
        round=round_,
        state={"w": np.arange(6, dtype=np.float32).reshape(2, 3), "note": {"mu": 1.5}},
        outer_state={"m": {"w": np.ones(3)}, "t": 4, "lr": 0.1},
        rng_state=rng.bit_generator.state,
        identity={"task": "digits", "seed": 0})


def test_a_checkpoint_round_trips_arrays_json_outer_state_and_the_rng(tmp_path):
    save_checkpoint(tmp_path, sample())
    back = load_checkpoint(tmp_path)
    assert back.round == 3
    assert back.state["w"].dtype == np.float32
    assert np.array_equal(back.state["w"], np.arange(6).reshape(2, 3))
    assert back.state["note"] == {"mu": 1.5}
    assert np.array_equal(back.outer_state["m"]["w"], np.ones(3))
    assert back.outer_state["t"] == 4
    restored = np.random.default_rng(0)
    restored.bit_generator.state = back.rng_state
    original = np.random.default_rng(5)
    original.random(3)
    assert restored.random() == original.random(), "sampling continues where it stopped"


def test_a_new_checkpoint_replaces_the_old_one_without_leaving_temporaries(tmp_path):
    save_checkpoint(tmp_path, sample(1))
    save_checkpoint(tmp_path, sample(2))
    assert load_checkpoint(tmp_path / "checkpoint.npz").round == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.npz"]


def test_a_save_removes_temporaries_a_crash_left_but_not_a_fresh_one(tmp_path):
    stale = tmp_path / ".checkpoint-crashed.npz.tmp"
    fresh = tmp_path / ".checkpoint-in-progress.npz.tmp"
    stale.write_bytes(b"half a checkpoint")
    fresh.write_bytes(b"another writer, still writing")
    old = time.time() - 2 * STALE_TEMPORARY_SECONDS
    os.utime(stale, (old, old))
    save_checkpoint(tmp_path, sample(1))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".checkpoint-in-progress.npz.tmp", "checkpoint.npz"]


def test_a_failed_write_leaves_the_previous_checkpoint_intact(tmp_path):
    save_checkpoint(tmp_path, sample(1))
    bad = Checkpoint(round=2, state={"w": np.array([object()], dtype=object)})
    with pytest.raises(ConfigError, match="only pickle"):
        save_checkpoint(tmp_path, bad)
    assert load_checkpoint(tmp_path).round == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.npz"]


def test_loading_never_unpickles(tmp_path):
    # An npz smuggling a pickled object array is refused, not executed.
    np.savez(tmp_path / "checkpoint.npz", __meta__=np.frombuffer(b"{}", dtype=np.uint8),
             evil=np.array([{"x": 1}], dtype=object))
    with pytest.raises(ConfigError, match="unreadable"):
        load_checkpoint(tmp_path)


def test_a_missing_checkpoint_says_there_is_nothing_to_resume(tmp_path):
    with pytest.raises(ConfigError, match="nothing to resume from"):
        load_checkpoint(tmp_path)


def _header(text: bytes) -> np.ndarray:
    return np.frombuffer(text, dtype=np.uint8)


def _write_truncated(path):
    save_checkpoint(path.parent, Checkpoint(round=1, state={"w": np.ones(64)}))
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])


CORRUPTIONS = {
    "truncated (torn copy)": _write_truncated,
    "empty file": lambda p: p.write_bytes(b""),
    "zip magic then garbage": lambda p: p.write_bytes(b"PK\x03\x04" + b"\x00" * 64),
    "a bare .npy array": lambda p: p.write_bytes(_npy_bytes()),
    "header not utf-8": lambda p: _savez(p, __meta__=_header(b"\xff\xfe")),
    "header not json": lambda p: _savez(p, __meta__=_header(b"not json")),
    "header a list": lambda p: _savez(p, __meta__=_header(b"[1, 2]")),
    "header missing round": lambda p: _savez(p, __meta__=_header(b'{"format": 1}')),
    "dangling array reference": lambda p: _savez(p, __meta__=_header(json.dumps({
        "format": 1, "round": 1, "state": {"w": {"__array__": "state/w"}}, "outer": {},
        "rng": {}, "identity": {}}).encode())),
}


def _savez(path, **arrays):
    with open(path, "wb") as fh:
        np.savez(fh, **arrays)


def _npy_bytes() -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.arange(3))
    return buf.getvalue()


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_corrupted_checkpoint_is_a_clear_config_error_not_a_traceback(tmp_path, corruption):
    path = tmp_path / "checkpoint.npz"
    CORRUPTIONS[corruption](path)
    with pytest.raises(ConfigError, match=r"checkpoint .*checkpoint\.npz"):
        load_checkpoint(tmp_path)


def test_a_bfloat16_state_survives_a_checkpoint_with_its_dtype(tmp_path):
    w = np.array([1.5, -2.25, 3.0], dtype=BFLOAT16)
    save_checkpoint(tmp_path, Checkpoint(round=2, state={"w": w, "b": np.zeros(2)},
                                         outer_state={"m": {"w": w.copy()}}))
    back = load_checkpoint(tmp_path)
    assert back.state["w"].dtype == BFLOAT16
    assert back.outer_state["m"]["w"].dtype == BFLOAT16
    assert np.array_equal(back.state["w"].astype(np.float32), w.astype(np.float32))
    assert back.state["b"].dtype == np.float64


@pytest.mark.parametrize("state, says", [
    ({"conv\0weight": np.zeros(2)}, "NUL"),
    ({"bad\udcffkey": np.zeros(2)}, "surrogate"),
    ({"a/b": np.zeros(2), "a": {"b": np.ones(2)}}, "same path"),
], ids=["nul", "lone-surrogate", "two-keys-one-path"])
def test_a_key_the_checkpoint_cannot_hold_is_refused_at_save(tmp_path, state, says):
    # Before: the NUL key was written and the loader then called the file
    # corrupt; the colliding keys silently came back as one array twice.
    save_checkpoint(tmp_path, sample(round_=1))
    with pytest.raises(StateError, match=says) as info:
        save_checkpoint(tmp_path, Checkpoint(round=2, state=state))
    assert "nothing was written" in str(info.value)
    assert load_checkpoint(tmp_path).round == 1  # the previous checkpoint stands


def test_keys_with_slashes_dots_and_newlines_still_round_trip(tmp_path):
    state = {"a/b": np.zeros(2), "x.npy": np.ones(1), "line\nbreak": np.arange(3.0), "": 1.0}
    save_checkpoint(tmp_path, Checkpoint(round=1, state=state))
    loaded = load_checkpoint(tmp_path).state
    assert sorted(loaded) == sorted(state)
    for key, value in state.items():
        assert np.array_equal(loaded[key], value)


def test_a_large_array_is_written_from_its_memory_not_copied_in_chunks(tmp_path):
    """np.savez to a file object copies each array through 16 MiB bytes chunks, which
    the coordinator's heap kept after every checkpoint (issue 39): the checkpoint writes
    numeric arrays straight from their memory, and reads back the same."""
    import tracemalloc

    big = np.random.default_rng(0).random(6 << 20).astype(np.float32)  # 24 MiB
    odd = np.asfortranarray(np.arange(12.0).reshape(3, 4))  # numpy writes it as savez would
    checkpoint = Checkpoint(round=1, state={"w": big, "f": odd, "h": big[:9].astype(BFLOAT16)},
                            identity={"task": "t"})
    tracemalloc.start()
    try:
        save_checkpoint(tmp_path, checkpoint)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"saving traced {peak / 2**20:.1f} MiB of temporaries"
    back = load_checkpoint(tmp_path)
    assert back.state["w"].tobytes() == big.tobytes()
    assert np.array_equal(back.state["f"], odd) and back.state["h"].dtype == BFLOAT16
    with np.load(tmp_path / "checkpoint.npz", allow_pickle=False) as data:  # a plain .npz
        assert sorted(data.files) == ["__meta__", "state/f", "state/h", "state/w"]
