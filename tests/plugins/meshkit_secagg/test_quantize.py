"""Fixed point mod 2**bits: clipped, rounded to the nearest level, and the sum dequantised."""

from __future__ import annotations

import numpy as np
import pytest

from meshkit import AggregationError
from meshkit_secagg import SecAggParams, dequantize, quantize


@pytest.fixture
def params() -> SecAggParams:
    return SecAggParams(clients=50, degree=0, threshold=10, clip_range=0.5, modulus_bits=32)


def test_a_value_comes_back_within_half_a_step(params: SecAggParams) -> None:
    x = np.random.default_rng(2).uniform(-0.5, 0.5, size=10_000)
    q = quantize(x, params)
    assert q.dtype == np.uint32 and int(q.max()) <= params.levels
    step = 2 * params.clip_range / params.levels
    assert np.abs(dequantize(q, params, 1) - x).max() <= step / 2 * (1 + 1e-9)


def test_values_beyond_the_clip_range_are_clipped(params: SecAggParams) -> None:
    q = quantize(np.array([-3.0, -0.5, 0.0, 0.5, 7.0]), params)
    assert q.tolist() == [0, 0, round(params.levels / 2), params.levels, params.levels]


def test_the_sum_of_the_whole_cohort_at_the_top_fits_the_modulus(params: SecAggParams) -> None:
    top = quantize(np.full(4, 100.0), params).astype(np.uint64)
    total = top * params.clients
    assert int(total.max()) < 2 ** params.modulus_bits
    assert np.allclose(dequantize(total, params, params.clients), params.clients * 0.5)


def test_a_sum_dequantises_to_the_sum_of_its_clipped_inputs(params: SecAggParams) -> None:
    rng = np.random.default_rng(3)
    xs = [rng.normal(0, 0.3, size=500) for _ in range(20)]
    total = np.sum([quantize(x, params).astype(np.uint64) for x in xs], axis=0)
    expected = np.sum([np.clip(x, -0.5, 0.5) for x in xs], axis=0)
    step = 2 * params.clip_range / params.levels
    assert np.abs(dequantize(total, params, 20) - expected).max() <= 20 * step / 2


def test_a_non_finite_update_is_an_error_never_a_quantised_value(params: SecAggParams) -> None:
    with pytest.raises(AggregationError, match="NaN or infinity"):
        quantize(np.array([0.0, np.nan]), params)
    with pytest.raises(AggregationError):
        quantize(np.array([np.inf]), params)


def test_quantising_leaves_the_callers_array_alone(params: SecAggParams) -> None:
    x = np.array([-2.0, 0.1, 3.0])
    quantize(x, params)
    assert x.tolist() == [-2.0, 0.1, 3.0]
