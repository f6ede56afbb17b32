"""Stochastic quantisation is unbiased: the mean of many encodings is the vector, within its
confidence interval -- and a biased rounding would be caught by the same test."""

from __future__ import annotations

import numpy as np
import pytest

import meshkit.plugins

DRAWS = 2000


def _mean_and_interval(compressor, x):
    draws = np.stack([compressor.decode(compressor.encode(x, seed=s), x.size)
                      for s in range(DRAWS)]).astype(np.float64)
    # 99.99% two-sided interval of the mean, with the spread pooled over coordinates.
    return draws.mean(axis=0), 3.9 * np.sqrt(draws.var(axis=0, ddof=1).mean() / DRAWS)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("rotate", [False, True])
def test_the_mean_of_many_stochastic_quantisations_is_the_vector(bits, rotate):
    x = np.random.default_rng(1).standard_normal(300).astype(np.float32) * 3
    compressor = meshkit.plugins.create("compression", "quantize",
                                        {"bits": bits, "chunk": 64, "rotate": rotate})
    mean, half = _mean_and_interval(compressor, x)
    assert half > 0
    outside = np.abs(mean - x) > half
    # At 99.99% per coordinate, 300 coordinates leave none outside but by chance (p ~ 3%).
    assert outside.sum() <= 1, np.flatnonzero(outside)


def test_the_same_interval_catches_a_biased_rounding():
    x = np.random.default_rng(1).standard_normal(300).astype(np.float32) * 3
    honest = meshkit.plugins.create("compression", "quantize", {"bits": 2, "chunk": 64})

    class Nearest:
        """The same grid, rounded to the nearest level: biased."""

        def encode(self, v, *, seed):
            fields = honest.encode(v, seed=seed)
            size, levels = v.size, 3
            per = np.repeat(np.arange(fields["lo"].size), 64)[:size]
            step = np.where(fields["step"] > 0, fields["step"], 1)[per]
            codes = np.clip(np.rint((v - fields["lo"][per]) / step), 0, levels)
            from meshkit_compression.quantize import _pack
            return {**fields, "codes": _pack(codes.astype(np.uint8), 2)}

        def decode(self, fields, size):
            return honest.decode(fields, size)

    mean, half = _mean_and_interval(Nearest(), x)
    assert (np.abs(mean - x) > half).sum() > 30


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_on_the_secure_rounds_shared_grid_the_mean_of_many_decoded_sums_is_the_sum(bits):
    # What secure aggregation decodes: the sum of 5 clients' codes on [-c, c], decoded once.
    rng = np.random.default_rng(2)
    clip = 2.0
    xs = [np.clip(rng.standard_normal(300), -clip, clip) for _ in range(5)]
    compressor = meshkit.plugins.create("compression", "quantize", {"bits": bits})
    draws = np.stack([
        compressor.decode_field(sum(compressor.encode_field(x, seed=s * 10 + c, clip_range=clip)
                                    .astype(np.int64) for c, x in enumerate(xs)),
                                clip_range=clip, count=len(xs))
        for s in range(DRAWS)])
    want = np.sum(xs, axis=0)
    half = 3.9 * np.sqrt(draws.var(axis=0, ddof=1).mean() / DRAWS)
    assert half > 0
    outside = np.abs(draws.mean(axis=0) - want) > half
    assert outside.sum() <= 1, np.flatnonzero(outside)
    # Each code is on the grid, below 2**bits.
    codes = compressor.encode_field(xs[0], seed=0, clip_range=clip)
    assert codes.dtype == np.uint32 and int(codes.max()) < 1 << bits
