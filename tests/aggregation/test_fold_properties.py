"""Property: the streaming fold equals the batch result, whatever the arrival order.

Floating-point addition is not associative, so "equal" has a stated
tolerance. For an element whose contributions are ``x_i`` with weights
``w_i``, the folded and the batch mean may differ by at most::

    4 * n * eps(acc) * sum_i(w_i * |x_i|) / sum_i(w_i)  +  ulp_out(|mean|)

where ``eps(acc)`` is the machine epsilon of the accumulation dtype
(float32 for float16/bfloat16/float32, float64 for float64), ``n`` the
number of contributors, and the last term allows the two results to round
to neighbouring values of the output dtype. JSON numbers are summed in
Python floats, with the same bound at float64 epsilon. The streaming fold
groups additions by its ``retain`` setting and the batch path adds
everything in one group; in the same order and grouping the two are
bit-identical.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from meshkit.aggregation import MeanFold, aggregate_by_folding
from meshkit.state import BFLOAT16, accumulate_dtype

DTYPES = [np.float16, BFLOAT16, np.float32, np.float64]


def _ulp(value: np.ndarray, dtype) -> np.ndarray:
    finfo = np.finfo(np.float32 if dtype == BFLOAT16 else dtype)
    eps = 2.0 ** -7 if dtype == BFLOAT16 else float(finfo.eps)
    return eps * np.abs(value) + float(finfo.tiny) if dtype != BFLOAT16 else \
        eps * np.abs(value) + 1e-38


@hst.composite
def rounds(draw):
    n = draw(hst.integers(1, 7))
    dtype = draw(hst.sampled_from(DTYPES))
    size = draw(hst.integers(1, 40))
    chunk = draw(hst.sampled_from([3, 16, 1 << 16]))
    weighted = draw(hst.booleans())
    retain = draw(hst.sampled_from([0, 1, 2, 3, None]))
    values = hst.floats(-1e3, 1e3, allow_nan=False, width=32)
    arrays = [np.array(draw(hst.lists(values, min_size=size, max_size=size)), dtype=dtype)
              for _ in range(n)]
    numbers = [draw(hst.floats(-1e3, 1e3, allow_nan=False)) for _ in range(n)]
    if weighted:
        weights = [draw(hst.floats(0, 100, allow_nan=False)) for _ in range(n)]
        if sum(weights) == 0:
            weights[0] = 1.0
    else:
        weights = [1.0] * n
    order = draw(hst.permutations(range(n)))
    states = [{"w": a, "meta": {"x": x, "tag": "same"}} for a, x in zip(arrays, numbers)]
    return states, weights, order, weighted, chunk, dtype, retain


@settings(max_examples=150, deadline=None)
@given(rounds())
def test_the_streaming_fold_equals_the_batch_result_in_any_order(case):
    states, weights, order, weighted, chunk, dtype, retain = case
    batch = aggregate_by_folding(MeanFold(weighted=weighted, retain=None), states, weights)
    fold = MeanFold(weighted=weighted, chunk=chunk, retain=retain)
    for i in order:
        fold.add(states[i], weights[i], source=f"rank {i + 1}")
    streamed = fold.result()

    assert streamed["w"].dtype == np.dtype(dtype) == batch["w"].dtype
    n = len(states)
    w = np.array(weights, dtype=np.float64)
    w = w / w.max()  # only ratios matter; keeps subnormal weights out of the reference
    xs = np.stack([s["w"].astype(np.float64) for s in states])
    scale = (w[:, None] * np.abs(xs)).sum(axis=0) / w.sum()
    eps = float(np.finfo(accumulate_dtype(dtype)).eps)
    a = streamed["w"].astype(np.float64)
    b = batch["w"].astype(np.float64)
    bound = 4 * n * eps * scale + _ulp(np.maximum(np.abs(a), np.abs(b)), dtype)
    assert np.all(np.abs(a - b) <= bound), (a, b, bound)

    xj = np.array([s["meta"]["x"] for s in states])
    json_bound = 4 * n * 2.0 ** -52 * float((w * np.abs(xj)).sum() / w.sum())
    assert abs(streamed["meta"]["x"] - batch["meta"]["x"]) <= json_bound + 1e-300
    assert streamed["meta"]["tag"] == "same"


@settings(max_examples=60, deadline=None)
@given(rounds())
def test_in_the_same_order_and_grouping_fold_and_batch_are_bit_identical(case):
    states, weights, _, weighted, chunk, dtype, _ = case
    batch = aggregate_by_folding(MeanFold(weighted=weighted, retain=None), states, weights)
    fold = MeanFold(weighted=weighted, chunk=chunk, retain=None)
    for state, weight in zip(states, weights):
        fold.add(state, weight)
    streamed = fold.result()
    assert streamed["w"].tobytes() == batch["w"].tobytes()
    assert streamed["meta"] == batch["meta"]


@settings(max_examples=60, deadline=None)
@given(rounds())
def test_the_fold_is_close_to_the_exact_weighted_mean(case):
    states, weights, order, weighted, chunk, dtype, retain = case
    fold = MeanFold(weighted=weighted, chunk=chunk, retain=retain)
    for i in order:
        fold.add(states[i], weights[i])
    got = fold.result()["w"].astype(np.float64)
    w = np.array(weights, dtype=np.float64)
    w = w / w.max()  # only ratios matter; keeps subnormal weights out of the reference
    xs = np.stack([s["w"].astype(np.float64) for s in states])
    exact = (w[:, None] * xs).sum(axis=0) / w.sum()
    scale = (w[:, None] * np.abs(xs)).sum(axis=0) / w.sum()
    eps = float(np.finfo(accumulate_dtype(dtype)).eps)
    bound = 4 * len(states) * eps * scale + _ulp(np.maximum(np.abs(got), np.abs(exact)), dtype)
    assert np.all(np.abs(got - exact) <= bound), (got, exact, bound)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_single_contribution_in_any_chunking_is_exact(dtype):
    x = (np.random.default_rng(5).standard_normal(100) * 50).astype(dtype)
    for chunk in (1, 7, 100, 1 << 16):
        fold = MeanFold(chunk=chunk, retain=0)
        fold.add({"x": x}, 0.37)
        assert fold.result()["x"].tobytes() == x.tobytes()
