"""The strict mean's bits, written down: the fold equals a whole-array formula exactly.

``MeanFold`` adds contributions in groups (``retain + 1`` at a time, in
arrival order), each contribution scaled by its weight relative to the first
positive weight, each group summed left to right before it is added to the
accumulator, the mass divided out at the end. Chunking, threads and which
passes a chunk takes are the implementation's to choose; the formula below
is not. This pins it, so a faster fold can be checked against it bit for bit.
"""

from __future__ import annotations

import math
from typing import Any
from unittest import mock

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as hst

from meshkit.aggregation import MeanFold, _threads
from meshkit.state import BFLOAT16, accumulate_dtype


def _scaled(x: np.ndarray, factor: float, acc_dtype: np.dtype) -> np.ndarray:
    """``factor * x`` in the accumulation dtype (widened first; a plain part is x itself)."""
    if x.dtype == acc_dtype:
        return x if factor == 1.0 else x * factor
    wide = x.astype(acc_dtype)
    return wide if factor == 1.0 else wide * factor


def reference(arrays: list[np.ndarray], weights: list[float], *, weighted: bool,
              retain: int | None) -> np.ndarray:
    """The strict mean of ``arrays`` as the fold defines it, one whole-array op at a time."""
    acc_dtype = accumulate_dtype(arrays[0].dtype)
    factors, base = [], None
    for w in weights:
        if not weighted:
            factors.append(1.0)
        elif base is None:
            factors.append(1.0 if w > 0 else 0.0)
            base = w if w > 0 else None
        else:
            factors.append(w / base)
    if len(arrays) == 1:
        return arrays[0].copy()
    size = len(arrays) if retain is None else retain + 1
    acc = None
    for lo in range(0, len(arrays), size):
        group = [_scaled(x, f, acc_dtype)
                 for x, f in zip(arrays[lo:lo + size], factors[lo:lo + size])]
        total = group[0]
        for part in group[1:]:
            total = total + part
        acc = total if acc is None else acc + total
    assert acc is not None
    divisor = math.fsum(factors)
    if divisor != 1.0:
        acc = acc / divisor
    return acc.astype(arrays[0].dtype)


def inputs(seed: int, n: int, size: int, dtype: Any, *, weighted: bool,
           equal: bool) -> tuple[list[np.ndarray], list[float]]:
    """``n`` arrays of ``size`` over seven decades, and their weights: unequal ones include
    zeros, with the first positive one anywhere (factors 0, 1 and others)."""
    rng = np.random.default_rng(seed)
    arrays = [(rng.standard_normal(size) * 10.0 ** rng.integers(-3, 4)).astype(dtype)
              for _ in range(n)]
    if weighted and not equal:
        weights = [float(rng.choice([0.0, 0.5, 1.0, 3.0, 17.25, 100.0])) for _ in range(n)]
        if not any(weights):
            weights[-1] = 2.0
    else:
        weights = [1.0] * n
    return arrays, weights


@settings(max_examples=200, deadline=None)
@given(n=hst.integers(1, 7), size=hst.integers(1, 50),
       chunk=hst.sampled_from([1, 4, 7, 16, 1 << 16]), threads=hst.integers(1, 3),
       retain=hst.sampled_from([0, 1, 2, 3, None]), weighted=hst.booleans(),
       equal=hst.booleans(),
       dtype=hst.sampled_from([np.float16, BFLOAT16, np.float32, np.float64]),
       seed=hst.integers(0, 2 ** 16))
def test_the_fold_is_the_formula_bit_for_bit(n, size, chunk, threads, retain, weighted,
                                             equal, dtype, seed):
    arrays, weights = inputs(seed, n, size, dtype, weighted=weighted, equal=equal)
    folding = MeanFold(weighted=weighted, retain=retain, chunk=chunk, threads=threads)
    with mock.patch.object(_threads, "_THREADED_MIN_ELEMENTS", 0):
        for x, w in zip(arrays, weights):
            folding.add({"x": x}, w)
        got = folding.result()["x"]
    want = reference(arrays, weights, weighted=weighted, retain=retain)
    assert got.dtype == want.dtype
    assert got.tobytes() == want.tobytes()


def test_the_formula_tells_groupings_apart():
    # The reference is not vacuous: another grouping gives other bits here.
    # In pairs, 1 + (e + e) keeps 2e; one at a time, each e rounds away against 1.
    arrays = [np.array([v], dtype=np.float32) for v in (1.0, 2.0 ** -24, 2.0 ** -24, 2.0 ** -24)]
    pairs = reference(arrays, [1.0] * 4, weighted=False, retain=1)
    whole = reference(arrays, [1.0] * 4, weighted=False, retain=0)
    assert pairs.tobytes() != whole.tobytes()
