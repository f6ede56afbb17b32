"""Common random numbers: central and distributed DP's noise from the same draws, for paired benchmarks.

A benchmarking aid, never a privacy setting. Rule: it acts only where a run
already draws *seeded* noise (``[privacy] noise = "seeded"``, which has no
privacy against whoever knows the seed) and only while the environment
variable :data:`COMMON_NOISE_ENV` names a key; a run with ``noise = "os"``
never reads it, and a seeded run without it draws exactly what it drew
before. ``benchmarks/distributed_dp.py --paired`` sets it (issue 41), so that
a seed's central and distributed runs differ only by what distinguishes the
two mechanisms, and their scores become correlated enough to compare with a
few dozen seeds instead of hundreds.

The construction: for (key, round, slot, coordinate) two uniforms u₁, u₂
from a stream of their own (``SeedSequence([key, round, slot, STREAM])``);
``slot`` is a client's place in the round's sorted cohort.

* distributed: the client in ``slot`` adds X − Y with X, Y the exact
  Poisson(v/2) quantiles of u₁, u₂ (:func:`common_skellam`): X − Y is
  Skellam(v), the law of :func:`~meshkit.privacy.skellam_noise`'s draw;
* central: the sum of a cohort of n gets σ·Σ_slot (Φ⁻¹(u₁) − Φ⁻¹(u₂))/√(2n)
  (:func:`common_normal`): a sum of 2n independent standard normals over
  √(2n), exactly N(0, σ²).

For a Poisson of large mean, its quantile of u is about λ + √λ·Φ⁻¹(u), so
the two noises are almost proportional, coordinate by coordinate. Each run
keeps its mechanism's marginal law exactly (tests/privacy/test_common_noise.py
checks both); only the dependence *between* the two runs is new. The
Poisson table spans λ ± (12√λ + 40): the mass left outside (mapped to the
table's last entry) is below 1e-30.
"""

from __future__ import annotations

import math
import os
from functools import lru_cache
from statistics import NormalDist

import numpy as np

__all__ = ["COMMON_NOISE_ENV", "common_noise_key", "common_uniforms", "common_skellam",
           "common_normal"]

#: The benchmark's switch: an integer key (the paired runs' seed) in the environment.
COMMON_NOISE_ENV = "MESHKIT_BENCH_COMMON_NOISE"
#: The uniforms' stream, apart from every other seeded stream of a run.
STREAM = 0xC0AA
_inverse = np.vectorize(NormalDist().inv_cdf, otypes=[np.float64])


def common_noise_key(noise: str | None) -> int | None:
    """The common key when a run's ``noise`` source is ``"seeded"`` and the environment sets
    one; ``None`` otherwise (``"os"`` noise never reads the environment)."""
    if noise != "seeded":
        return None
    text = os.environ.get(COMMON_NOISE_ENV, "")
    return int(text) if text.strip() else None


def common_uniforms(key: int, round_: int, slot: int, length: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """u₁, u₂ (``length`` each) of one cohort slot in one round, in (0, 1)."""
    rng = np.random.default_rng(np.random.SeedSequence([key, round_, slot, STREAM]))
    u = rng.random((2, length))
    u[u == 0.0] = 0.5  # probability 2^-53 a draw: Φ⁻¹(0) is not a number
    return u[0], u[1]


@lru_cache(maxsize=64)
def _poisson_cdf(mean: float) -> tuple[int, np.ndarray]:
    """(first value, CDF) of Poisson(``mean``) over mean ± (12√mean + 40), built from the
    mode by the ratio p(m)/p(m−1) = mean/m (no large terms cancel)."""
    spread = 12 * math.sqrt(mean) + 40
    mode = math.floor(mean)
    low, high = max(0, math.floor(mean - spread)), math.ceil(mean + spread)
    values = np.arange(low, high + 1, dtype=np.float64)
    log_ratio = math.log(mean) - np.log(np.maximum(values, 1.0)) if mean > 0 else None
    logp = np.zeros(values.size)
    at = mode - low
    if log_ratio is not None:
        logp[at + 1:] = np.cumsum(log_ratio[at + 1:])  # log p(m)/p(mode), m above the mode
        logp[:at] = -np.cumsum(log_ratio[1:at + 1][::-1])[::-1]  # and below it
    p = np.exp(logp) if mean > 0 else (values == 0).astype(np.float64)
    cdf = np.cumsum(p)
    cdf /= cdf[-1]
    return low, cdf


def _poisson_quantile(u: np.ndarray, mean: float) -> np.ndarray:
    low, cdf = _poisson_cdf(float(mean))
    index = np.searchsorted(cdf, u, side="left")
    return low + np.minimum(index, cdf.size - 1).astype(np.int64)


def common_skellam(key: int, round_: int, slot: int, variance: float, length: int
                   ) -> np.ndarray:
    """The Skellam(``variance``) share (int64) of the client in cohort ``slot``."""
    u1, u2 = common_uniforms(key, round_, slot, length)
    half = variance / 2
    return _poisson_quantile(u1, half) - _poisson_quantile(u2, half)


def common_normal(key: int, round_: int, contributors: int, length: int) -> np.ndarray:
    """A standard normal vector for the sum of ``contributors`` clients (slots 0..n−1;
    slot 0 alone when nobody contributed): multiply by σ for the sum's noise."""
    n = max(int(contributors), 1)
    total = np.zeros(length)
    for slot in range(n):
        u1, u2 = common_uniforms(key, round_, slot, length)
        total += _inverse(u1)
        total -= _inverse(u2)
    total /= math.sqrt(2 * n)
    return total
