"""The exact sum of clipped updates: the same bits however it is split, sensitivity S, and a
partial that was not clipped is bounded as its n clients' updates would be."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest

from meshkit import AggregationError
from meshkit.privacy import COHORT_BITS, ClippedSum, clip_bits, one_bit


def _reference(d: int = 300) -> dict:
    rng = np.random.default_rng(7)
    return {"w": rng.normal(size=d).astype(np.float32), "b": rng.normal(size=5),
            "steps": np.array([3], np.int64), "meta": {"lr": 0.1}}


def _clients(ref: dict, n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    scales = rng.choice([1e-3, 0.05, 0.3, 2.0, 50.0], size=n)
    return [dict(ref, w=(ref["w"] + rng.normal(size=ref["w"].shape) * s).astype(np.float32),
                 b=ref["b"] + rng.normal(size=5) * s) for s in scales]


def _norm(total: dict) -> float:
    return math.sqrt(sum(float(np.sum(v * v)) for v in total.values()))


def test_the_sum_is_the_same_bits_added_flat_or_merged_per_worker_in_any_split() -> None:
    ref, clients = _reference(), _clients(_reference(), 23)
    flat = ClippedSum(ref, clip_norm=1.0)
    for i, state in enumerate(clients):
        flat.add(state, source=f"client {i}")
    rng = np.random.default_rng(3)
    for _ in range(5):  # workers folding random subsets, merged in a random order
        owner = rng.integers(0, 4, size=len(clients))
        merged = ClippedSum(ref, clip_norm=1.0)
        for worker in rng.permutation(4):
            mine = ClippedSum(ref, clip_norm=1.0)
            for i in np.flatnonzero(owner == worker):
                mine.add(clients[i])
            if mine.count:
                merged.merge(mine.partial(), unclipped=mine.unclipped)
        assert merged.count == flat.count and merged.unclipped == flat.unclipped
        for key in flat.keys:
            np.testing.assert_array_equal(merged.total()[key], flat.total()[key])


def test_it_is_the_float64_sum_of_clipped_updates_within_its_resolution() -> None:
    ref, clients = _reference(), _clients(_reference(), 12)
    fold = ClippedSum(ref, clip_norm=0.5)
    want = {k: np.zeros(ref[k].shape) for k in fold.keys}
    for state in clients:
        fold.add(state)
        delta = {k: state[k].astype(np.float64) - ref[k].astype(np.float64) for k in fold.keys}
        norm = _norm(delta)
        for k in fold.keys:
            want[k] += delta[k] * min(1.0, 0.5 / norm)
    # each term is rounded once to 2^-F, and clipped 1e-12 + sqrt(d) 2^-(F+1) below S
    unit = 2.0 ** -fold.fraction_bits
    assert fold.fraction_bits == clip_bits(0.5) == 62 - COHORT_BITS + 1
    for k in fold.keys:
        np.testing.assert_allclose(fold.total()[k], want[k], rtol=0, atol=len(clients) * (
            unit + 0.5 * (1e-12 + math.sqrt(305) * unit)))
    assert fold.unclipped == sum(n <= 0.5 for n in fold.norms)


@pytest.mark.parametrize("clip", [1e-9, 1.0, 3e5, 1e12])
def test_every_rounded_clipped_update_has_norm_at_most_s(clip: float) -> None:
    ref = {"w": np.zeros(100_000, np.float32)}
    rng = np.random.default_rng(int(clip * 1e9) % 2**32)
    for scale in (clip * 10, clip * 1e6):
        fold = ClippedSum(ref, clip_norm=clip)
        fold.add({"w": (rng.normal(size=100_000) * scale).astype(np.float32)})
        assert _norm(fold.total()) <= clip  # the sensitivity of the sum, after rounding
        assert _norm(fold.total()) > clip * (1 - 1e-6)


def test_a_partial_that_was_not_clipped_is_clipped_to_its_count_times_s(caplog) -> None:
    ref, clients = _reference(), _clients(_reference(), 6, seed=1)
    honest, flat = ClippedSum(ref, clip_norm=1.0), ClippedSum(ref, clip_norm=1.0)
    for state in clients:
        honest.add(state)
        flat.add(state)
    cheat = ClippedSum(ref, clip_norm=1.0)
    cheat.bound = math.inf  # a worker that does not clip
    for state in clients:
        cheat.add(state)
    coordinator = ClippedSum(ref, clip_norm=1.0)
    with caplog.at_level(logging.WARNING):
        coordinator.merge(cheat.partial(), unclipped=99, source="rank 3 (6 clients)")
    assert "rank 3 (6 clients) of 6 updates has norm" in caplog.text
    assert _norm(coordinator.total()) <= 6 * 1.0  # six clients' worth, no more
    assert _norm(coordinator.total()) > 6 * (1 - 1e-6)
    assert coordinator.unclipped == 6  # a count of bits, never more than the partial's fits
    # an honest partial is merged as it is, bit for bit
    again = ClippedSum(ref, clip_norm=1.0)
    with caplog.at_level(logging.WARNING):
        caplog.clear()
        again.merge(honest.partial(), unclipped=honest.unclipped)
    assert caplog.text == ""
    for key in again.keys:
        np.testing.assert_array_equal(again.total()[key], flat.total()[key])


def test_a_partial_of_another_model_or_resolution_is_refused() -> None:
    ref = _reference()
    fold = ClippedSum(ref, clip_norm=1.0)
    other = ClippedSum({"w": np.zeros(4)}, clip_norm=1.0)
    other.add({"w": np.ones(4)})
    with pytest.raises(AggregationError, match="not the float keys of the model"):
        fold.merge(other.partial(), source="rank 2")
    coarse = ClippedSum(ref, clip_norm=8.0)
    coarse.add(ref)
    with pytest.raises(AggregationError, match="rank 2 counts in 2\\^-35"):
        fold.merge(coarse.partial(), source="rank 2")


def test_a_bit_is_one_only_for_exactly_one() -> None:
    assert [one_bit(v) for v in (1, 1.0, 0, True, -1e9, 7, "1", None)] == [1, 1, 0, 0, 0, 0, 0, 0]


def test_a_bfloat16_parameter_is_released_and_a_float_carried_count_is_not() -> None:
    # BatchNorm's num_batches_tracked as meshkit.torch carries it: a float64 count named
    # in the state's INT_BUFFERS leaf. It is no update (it keeps the global model's
    # value); a bfloat16 parameter is one (np.floating does not know bfloat16).
    from meshkit.privacy import float_keys
    from meshkit.state import BFLOAT16, INT_BUFFERS

    ref = {**_reference(), "h": np.full(4, 0.5, BFLOAT16), "bn.count": np.array(100.0),
           INT_BUFFERS: {"bn.count": "int64"}}
    assert float_keys(ref) == ["b", "h", "w"]
    total = ClippedSum(ref, clip_norm=1.0)
    total.add(dict(ref, h=np.full(4, 0.625, BFLOAT16), **{"bn.count": np.array(116.0)}))
    assert sorted(total.total()) == ["b", "h", "w"]
    np.testing.assert_allclose(total.total()["h"], np.full(4, 0.125), rtol=0, atol=1e-6)
