"""The noised sum: clipping bounds every update, the noise is z·S/m on the mean, once."""

from __future__ import annotations

import numpy as np
import pytest

from meshkit import AggregationError
from meshkit.privacy import Accountant, clip_contribution
from meshkit_privacy import AdaptiveClip, GaussianMechanism, NoisedSum


def _reference(d: int = 400) -> dict:
    return {"w": np.zeros(d, np.float32), "b": np.ones(3, np.float64),
            "steps": np.array([5], np.int64), "meta": {"lr": 0.1}}


def test_over_many_rounds_of_zero_updates_the_noise_on_the_mean_is_z_s_over_m() -> None:
    z, s, m, rounds = 1.3, 0.7, 20.0, 250
    ref = _reference()
    rng = np.random.default_rng(0)
    released = []
    for _ in range(rounds):
        fold = NoisedSum(ref, clip_norm=s, noise_std=z * s, expected=m, rng=rng)
        for _ in range(5):  # five clients whose model did not move
            fold.add(ref)
        out = fold.result()
        released.append(np.concatenate([out["w"].astype(np.float64) - ref["w"],
                                        out["b"] - ref["b"]]))
    noise = np.stack(released)  # rounds x coordinates
    n = noise.size
    sigma = z * s / m
    # the sample std of n normal draws is sigma within a few sigma/sqrt(2n)
    assert noise.std() == pytest.approx(sigma, abs=4 * sigma / np.sqrt(2 * n))
    assert abs(noise.mean()) < 4 * sigma / np.sqrt(n)
    # per coordinate too: no coordinate is left out of the noise, none gets double
    per_coordinate = noise.std(axis=0)
    assert per_coordinate.min() > 0.75 * sigma and per_coordinate.max() < 1.25 * sigma


def test_each_clipped_update_has_norm_at_most_s_and_small_ones_are_untouched() -> None:
    ref = _reference(50)
    rng = np.random.default_rng(1)
    fold = NoisedSum(ref, clip_norm=1.0, noise_std=0.0, expected=10, rng=rng)
    scales = [0.01, 0.5, 3.0, 40.0, 1e4]
    for scale in scales:
        state = dict(ref, w=(rng.normal(size=50) * scale).astype(np.float32))
        fold.add(state)
    assert all(n <= 1.0 * (1 + 1e-12) for n in fold.clipped_norms)
    big = [n for n, c in zip(fold.norms, fold.clipped_norms) if n > 1.0]
    assert big and all(c == pytest.approx(1.0) for c in
                       [c for n, c in zip(fold.norms, fold.clipped_norms) if n > 1.0])
    small = [(n, c) for n, c in zip(fold.norms, fold.clipped_norms) if n <= 1.0]
    assert all(n == pytest.approx(c) for n, c in small)
    assert fold.unclipped == len(small)


def test_the_mean_divides_by_the_expected_cohort_not_the_realized_count() -> None:
    ref = {"w": np.zeros(2)}
    fold = NoisedSum(ref, clip_norm=10.0, noise_std=0.0, expected=4.0,
                     rng=np.random.default_rng(0))
    fold.add({"w": np.array([1.0, 0.0])})
    fold.add({"w": np.array([0.0, 2.0])})
    np.testing.assert_allclose(fold.result()["w"], [0.25, 0.5])


def test_only_float_arrays_are_released_the_rest_keep_the_global_value() -> None:
    ref = _reference(4)
    fold = NoisedSum(ref, clip_norm=1.0, noise_std=1.0, expected=1,
                     rng=np.random.default_rng(0))
    fold.add(dict(ref, steps=np.array([99]), meta={"lr": 5.0}))
    out = fold.result()
    assert out["steps"].tolist() == [5] and out["meta"] == {"lr": 0.1}
    assert out["w"].dtype == np.float32 and out["b"].dtype == np.float64


def test_a_contribution_missing_a_key_or_not_finite_is_an_aggregation_error() -> None:
    ref = {"w": np.zeros(3)}
    fold = NoisedSum(ref, clip_norm=1.0, noise_std=1.0, expected=1,
                     rng=np.random.default_rng(0))
    with pytest.raises(AggregationError, match="lacks key 'w'"):
        fold.add({}, source="client 3")
    with pytest.raises(AggregationError, match="client 4 key 'w' is not finite"):
        fold.add({"w": np.array([np.nan, 0, 0])}, source="client 4")


def test_a_client_clipped_update_reaches_the_sum_within_s() -> None:
    ref = {"w": np.full(100, 0.5, np.float32)}
    fitted = {"w": np.full(100, 3.0, np.float32)}
    clipped, norm = clip_contribution(ref, fitted, 0.25)
    assert norm == pytest.approx(25.0)
    fold = NoisedSum(ref, clip_norm=0.25, noise_std=0.0, expected=1,
                     rng=np.random.default_rng(0), clipped_by_clients=True)
    fold.add(clipped)
    assert fold.norms[0] == pytest.approx(0.25, rel=1e-5)
    assert fold.clipped_norms[0] <= 0.25 * (1 + 1e-12)


@pytest.mark.parametrize("placement", ["coordinator", "client"])
def test_adaptive_clipping_moves_s_towards_the_target_quantile(placement: str) -> None:
    def mechanism() -> GaussianMechanism:
        return GaussianMechanism(clip_norm=1.0, noise_multiplier=1.0, placement=placement,
                                 accountant=Accountant("rdp", 1e-5), noise="seeded",
                                 adaptive=AdaptiveClip(0.5, 0.2, 1.0))
    ref = {"w": np.zeros(4)}
    shrinking, growing = mechanism(), mechanism()
    for rnd in range(1, 6):
        for mech, size in ((shrinking, 1e-3), (growing, 1e3)):
            fold = mech.begin(ref, expected=20, seed=0, round_=rnd)
            for _ in range(20):
                fold.add({"w": np.full(4, size)})
            unclipped = fold.unclipped if placement == "client" else None
            mech.finish(fold, 0.1, unclipped=unclipped, seed=0, round_=rnd)
    # every update within S: S shrinks (b ~ 1 > 0.5); every one clipped: S grows
    assert shrinking.clip_norm < np.exp(-0.2 * 0.4 * 5) * 1.05
    assert growing.clip_norm > np.exp(0.2 * 0.4 * 5) * 0.95
    # the count's noise is accounted: 5 rounds at the effective multiplier
    assert shrinking.accountant.history == [[0.1, pytest.approx(2 ** -0.5), 5]]


def test_seeded_noise_repeats_and_os_noise_does_not() -> None:
    ref = {"w": np.zeros(8)}

    def release(noise: str) -> np.ndarray:
        mech = GaussianMechanism(clip_norm=1.0, noise_multiplier=1.0, noise=noise)
        return mech.begin(ref, expected=1, seed=3, round_=2).result()["w"]

    np.testing.assert_array_equal(release("seeded"), release("seeded"))
    assert not np.array_equal(release("os"), release("os"))
