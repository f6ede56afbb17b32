"""A model-sized sum arena is reused by a later fold only once nothing refers to it (issue 39).

The result of a float32 mean *is* its arena, so a reused arena that something
still referred to would overwrite a model in use: these tests hold results
(and views of them, and a torch-style buffer export) across later folds and
check every byte is unchanged, and that an arena nothing holds is reused.
"""

from __future__ import annotations

import numpy as np
import pytest

from meshkit.aggregation import MeanFold, PieceFold, float_layout, piece_plan
from meshkit.aggregation import _arenas

SHAPE = (64, 1024)  # 256 KiB of float32: above the lowered ARENA_MIN below


@pytest.fixture(autouse=True)
def small_arenas(monkeypatch):
    monkeypatch.setattr(_arenas, "ARENA_MIN", 64 << 10)
    monkeypatch.setattr(_arenas, "_kept", [])


def state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal(SHAPE).astype(np.float32), "step": 3}


def mean(seed: int) -> dict:
    fold = MeanFold(weighted=False)
    fold.add(state(seed), 1.0)
    fold.add(state(seed + 100), 1.0)
    return fold.result()


def expected(seed: int) -> np.ndarray:
    return ((state(seed)["w"] + state(seed + 100)["w"]) / np.float32(2)).astype(np.float32)


def test_a_result_held_is_never_overwritten_by_later_folds():
    first = mean(1)
    view = first["w"][3:9]  # a view alone must keep it too
    buffer = memoryview(mean(2)["w"])  # an exported buffer (as torch.from_numpy holds)
    before = first["w"].copy()
    snapshot = np.array(buffer, copy=True)
    for seed in range(3, 8):
        result = mean(seed)
        np.testing.assert_array_equal(result["w"], expected(seed))
        assert not np.shares_memory(result["w"], first["w"])
        assert not np.shares_memory(result["w"], np.asarray(buffer))
        del result
    np.testing.assert_array_equal(first["w"], before)
    np.testing.assert_array_equal(view, before[3:9])
    np.testing.assert_array_equal(np.asarray(buffer), snapshot)
    np.testing.assert_array_equal(first["w"], expected(1))


def test_an_arena_nothing_holds_is_the_next_folds():
    first = mean(1)
    address = first["w"].__array_interface__["data"][0]
    del first
    second = mean(2)
    # Reused, not a fresh mapping: the same memory, and the right numbers in it.
    assert second["w"].__array_interface__["data"][0] == address
    np.testing.assert_array_equal(second["w"], expected(2))


def test_the_model_in_use_and_the_one_before_it_take_turns():
    """As a round loop holds them: each round's result replaces the last one."""
    model = mean(0)
    addresses = set()
    for seed in range(1, 7):
        old = model["w"].copy()
        model, previous = mean(seed), model
        np.testing.assert_array_equal(previous["w"], old)  # untouched by this fold
        del previous
        addresses.add(model["w"].__array_interface__["data"][0])
    assert len(addresses) == 2
    assert len(_arenas._kept) == _arenas.KEEP


def test_a_piece_fold_reuses_the_arena_and_never_a_held_result():
    model = state(0)
    plan = piece_plan(float_layout(model), 64 << 10)
    assert len(plan) > 1

    def pieces_mean(seed: int) -> dict:
        fold = PieceFold(MeanFold(weighted=True), model, plan)
        for s in (seed, seed + 100):
            whole = state(s)
            flat = whole["w"].reshape(-1)
            fold.begin(1.0, f"c{s}")
            for index, piece in enumerate(plan):
                parts = {key: flat[lo:hi] for key, lo, hi in piece}
                if index == 0:
                    parts["step"] = 3
                fold.piece(index, parts)
            fold.end()
        return fold.result()

    held = pieces_mean(1)
    before = held["w"].copy()
    for seed in range(2, 5):
        np.testing.assert_array_equal(pieces_mean(seed)["w"], expected(seed))
    np.testing.assert_array_equal(held["w"], before)
    np.testing.assert_array_equal(held["w"], expected(1))


def test_small_arenas_are_not_kept(monkeypatch):
    monkeypatch.setattr(_arenas, "ARENA_MIN", 64 << 20)
    mean(1)
    assert _arenas._kept == []
