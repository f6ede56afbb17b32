"""The paired benchmark's common random numbers (``meshkit/privacy/_common_noise.py``).

Each run must keep its mechanism's noise law exactly (a coupled Skellam share is
Skellam(v), the coupled central noise N(0, σ²)); only the two runs' dependence is new.
And the coupling acts only on a seeded run whose environment names a key.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest

import meshkit
from meshkit.privacy import (COMMON_NOISE_ENV, SkellamPlan, common_noise_key, common_normal,
                             common_skellam, skellam_noise)


def _skellam_pmf(variance: float, support: int) -> dict[int, float]:
    """P[X − Y = k] for X, Y ~ Poisson(v/2), by the convolution of the two pmfs."""
    lam = variance / 2
    top = int(lam + 12 * math.sqrt(lam) + 40)
    poisson = [math.exp(-lam + m * math.log(lam) - math.lgamma(m + 1)) for m in range(top)]
    return {k: sum(poisson[m + k] * poisson[m] for m in range(max(0, -k), top - max(k, 0)))
            for k in range(-support, support + 1)}


def _chi_square_limit(df: int, z: float = 3.29) -> float:
    """The chi-square quantile at 1 − 5e-4 (Wilson–Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _coupled(variance: float, draws: int, rounds: int = 8) -> np.ndarray:
    return np.concatenate([common_skellam(7, r, s, variance, draws // (rounds * 4))
                           for r in range(rounds) for s in range(4)])


@pytest.mark.parametrize("variance", [0.5, 3.0, 40.0])
def test_a_coupled_skellam_share_has_the_skellam_law(variance):
    draws = 64_000
    sample = _coupled(variance, draws)
    support = int(3 * math.sqrt(variance)) + 1
    pmf = _skellam_pmf(variance, support)
    observed = np.clip(sample, -support - 1, support + 1)
    statistic, cells = 0.0, 0
    for k in range(-support - 1, support + 2):
        expected = draws * (pmf[k] if -support <= k <= support
                            else (1 - sum(pmf.values())) / 2)
        statistic += (np.count_nonzero(observed == k) - expected) ** 2 / expected
        cells += 1
    assert statistic < _chi_square_limit(cells - 1)
    # and against meshkit's own sampler: the same mean and variance, within 4 standard errors
    reference = skellam_noise(np.random.default_rng(1), variance, draws)
    se_var = variance * math.sqrt(2 / draws) * 1.5  # the Skellam's excess kurtosis is 1/v
    assert abs(sample.var() - reference.var()) < 4 * math.sqrt(2) * se_var * (1 + 1 / variance)
    assert abs(sample.mean()) < 4 * math.sqrt(variance / draws)


def test_a_coupled_share_of_the_benchmarks_size_matches_skellam_noise_by_ks():
    variance = (1.07 * 24_000) ** 2 / 25  # one of 25 clients' shares, z = 1.07, 24k steps
    n = 40_000
    ours = np.sort(_coupled(variance, n) / math.sqrt(variance))
    theirs = np.sort(skellam_noise(np.random.default_rng(2), variance, n) / math.sqrt(variance))
    grid = np.concatenate([ours, theirs])
    gap = np.max(np.abs(np.searchsorted(ours, grid, "right") / n
                        - np.searchsorted(theirs, grid, "right") / n))
    assert gap < 1.95 * math.sqrt(2 / n)  # the two-sample KS test at 0.1 %


@pytest.mark.parametrize("contributors", [0, 1, 25])
def test_the_coupled_central_noise_is_a_standard_normal(contributors):
    sample = np.concatenate([common_normal(3, r, contributors, 4_000) for r in range(10)])
    n = sample.size
    assert abs(sample.mean()) < 4 / math.sqrt(n)
    assert abs(sample.var() - 1) < 4 * math.sqrt(2 / n)
    ordered = np.sort(sample)
    cdf = np.array([NormalDist().cdf(x) for x in ordered])
    gap = max(np.max(np.arange(1, n + 1) / n - cdf), np.max(cdf - np.arange(n) / n))
    assert gap < 1.95 / math.sqrt(n)  # one-sample KS at 0.1 %


def test_the_two_noises_are_coupled_coordinate_by_coordinate():
    cohort, variance = 25, (1.07 * 24_000) ** 2 / 25
    distributed = sum(common_skellam(5, 9, slot, variance, 650) for slot in range(cohort))
    central = common_normal(5, 9, cohort, 650)
    assert np.corrcoef(distributed, central)[0, 1] > 0.9999
    # another round, another key: independent
    assert abs(np.corrcoef(distributed, common_normal(5, 10, cohort, 650))[0, 1]) < 0.2
    assert abs(np.corrcoef(distributed, common_normal(6, 9, cohort, 650))[0, 1]) < 0.2


def test_only_a_seeded_run_with_the_key_set_is_coupled(monkeypatch):
    monkeypatch.delenv(COMMON_NOISE_ENV, raising=False)
    assert common_noise_key("seeded") is None
    monkeypatch.setenv(COMMON_NOISE_ENV, "12")
    assert common_noise_key("seeded") == 12
    assert common_noise_key("os") is None  # OS noise never reads the environment
    central = meshkit.plugins.create("privacy", "dp-fixed", {"noise": "os"})
    reference = {"w": np.zeros(3, np.float32)}
    assert central.begin(reference, expected=2.0, seed=0, round_=1).common is None
    seeded = meshkit.plugins.create("privacy", "dp-fixed", {"noise": "seeded"})
    assert seeded.begin(reference, expected=2.0, seed=0, round_=4).common == (12, 4)


def test_the_central_fold_draws_the_common_noise_over_its_contributors(monkeypatch):
    monkeypatch.setenv(COMMON_NOISE_ENV, "3")
    mech = meshkit.plugins.create("privacy", "dp-fixed",
                                  {"noise": "seeded", "noise_multiplier": 2.0, "clip_norm": 0.5})
    reference = {"b": np.zeros(2, np.float64), "a": np.zeros((2, 3), np.float64)}
    fold = mech.begin(reference, expected=4.0, seed=0, round_=2)
    for value in (0.1, -0.15, 0.1):
        fold.add({"a": np.full((2, 3), value), "b": np.full(2, value)})
    released = fold.noised_sum()
    noise = common_normal(3, 2, 3, 8) * 1.0  # σ = z·S = 1 on the sum, keys in sorted order
    # the clipped updates sum to 0.05 a coordinate (exactly, up to the fixed point's 2^-F)
    np.testing.assert_allclose(released["a"].ravel() - 0.05, noise[:6], atol=1e-9)
    np.testing.assert_allclose(released["b"] - 0.05, noise[6:], atol=1e-9)
    monkeypatch.delenv(COMMON_NOISE_ENV)
    plain = mech.begin(reference, expected=4.0, seed=0, round_=2)
    for value in (0.1, -0.15, 0.1):
        plain.add({"a": np.full((2, 3), value), "b": np.full(2, value)})
    rng = np.random.default_rng(np.random.SeedSequence([0, 2, 0x5E55]))
    expected_a = rng.normal(0.0, 1.0, (2, 3)) + 0.05  # the seeded stream, as before
    np.testing.assert_allclose(plain.noised_sum()["a"], expected_a, atol=1e-9)


def test_a_share_given_to_encode_replaces_the_drawn_one_and_keeps_the_rounding():
    plan = SkellamPlan(scale=100.0, variance=50.0, bound=400.0, half=10_000, length=6,
                       cohort=2)
    update = np.array([0.3, -0.21, 0.004, 0.5, -0.6, 0.0])
    plain, _ = plan.encode(update, np.random.default_rng(4), np.int64)
    rng = np.random.default_rng(4)
    rounded = plan.round(update, rng)
    assert np.array_equal(plain, rounded + skellam_noise(rng, 50.0, 6) + plan.half)
    share = np.arange(6, dtype=np.int64) - 3
    given, _ = plan.encode(update, np.random.default_rng(4), np.int64, share)
    assert np.array_equal(given, rounded + share + plan.half)
