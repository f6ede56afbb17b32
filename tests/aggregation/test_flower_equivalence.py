"""The robust built-ins equal Flower 1.42's aggregate functions, and hand-computed cases.

With flwr installed (``pip install 'flwr==1.42.*'``, no torch needed) each
rule is compared with the function Flower's strategy calls
(``flwr.server.strategy.aggregate``: ``aggregate_median`` for FedMedian,
``aggregate_trimmed_avg`` for FedTrimmedAvg, ``aggregate_krum`` for Krum
and MultiKrum, ``aggregate_bulyan`` for Bulyan) on random rounds, float32
and float64, weighted where Flower weights (MultiKrum's mean), to 1e-6.
Ties: Flower breaks equal Krum scores by position, meshkit by content
(docs/aggregators.md), so the rounds are given to both in content order,
where the two rules coincide.
"""

from __future__ import annotations

import numpy as np
import pytest

import meshkit
from meshkit import AggregationError

flower = pytest.importorskip("flwr.server.strategy.aggregate",
                             reason="flwr is not installed (pip install 'flwr==1.42.*')")

SHAPES = {"a.weight": (4, 3), "a.bias": (4,), "b.weight": (2, 4)}


def _round(n: int, dtype: type, seed: int) -> tuple[list[dict], list[int]]:
    rng = np.random.default_rng(seed)
    states = [{k: (rng.standard_normal(s) * rng.uniform(0.5, 3)).astype(dtype)
               for k, s in SHAPES.items()} for _ in range(n)]
    # Content order: the lexicographic order of the flattened contributions.
    flat = [np.concatenate([s[k].ravel() for k in SHAPES]).astype(np.float64) for s in states]
    order = sorted(range(n), key=lambda i: tuple(flat[i]))
    examples = [int(x) for x in rng.integers(10, 200, size=n)]
    return [states[i] for i in order], [examples[i] for i in order]


def _flower(states: list[dict], examples: list[int]) -> list[tuple[list[np.ndarray], int]]:
    return [([s[k].copy() for k in SHAPES], e) for s, e in zip(states, examples)]


def _assert_equal(ours: dict, theirs: list[np.ndarray]) -> None:
    for key, expected in zip(SHAPES, theirs):
        np.testing.assert_allclose(ours[key].astype(np.float64),
                                   np.asarray(expected, dtype=np.float64),
                                   rtol=1e-6, atol=1e-6, err_msg=key)


DTYPES = [np.float32, np.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [5, 8, 13])
def test_median_equals_flowers_fedmedian(dtype, n):
    for seed in range(3):
        states, examples = _round(n, dtype, seed)
        ours = meshkit.plugins.create("aggregator", "median").aggregate(states, examples)
        _assert_equal(ours, flower.aggregate_median(_flower(states, examples)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("beta", [0.0, 0.1, 0.2, 0.3])
def test_trimmed_mean_equals_flowers_fedtrimmedavg(dtype, beta):
    for n in (7, 10, 20):
        states, examples = _round(n, dtype, n)
        ours = meshkit.plugins.create("aggregator", "trimmed-mean",
                                      {"beta": beta}).aggregate(states, examples)
        _assert_equal(ours, flower.aggregate_trimmed_avg(_flower(states, examples), beta))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("f", [0, 1, 3])
def test_krum_equals_flowers_krum(dtype, f):
    for seed in range(4):
        n = 2 * f + 3 + seed
        states, examples = _round(n, dtype, 100 + seed)
        ours = meshkit.plugins.create("aggregator", "krum", {"f": f}).aggregate(states, examples)
        _assert_equal(ours, flower.aggregate_krum(_flower(states, examples), f, 0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("f,m", [(1, 2), (2, 4), (2, 0)])
def test_multi_krum_equals_flowers_multikrum_weighted_by_examples(dtype, f, m):
    for seed in range(4):
        n = 2 * f + 3 + seed
        states, examples = _round(n, dtype, 200 + seed)
        keep = m or n - f  # meshkit's m = 0 is the paper's n - f; Flower's 0 is Krum
        ours = meshkit.plugins.create("aggregator", "multi-krum",
                                      {"f": f, "m": m}).aggregate(states, examples)
        _assert_equal(ours, flower.aggregate_krum(_flower(states, examples), f, keep))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("f", [1, 2])  # meshkit refuses f = 0: Bulyan is then the plain mean
def test_bulyan_equals_flowers_bulyan(dtype, f):
    for seed in range(3):
        n = 4 * f + 3 + seed
        states, examples = _round(n, dtype, 300 + seed)
        ours = meshkit.plugins.create("aggregator", "bulyan", {"f": f}).aggregate(states,
                                                                                examples)
        theirs = flower.aggregate_bulyan(_flower(states, examples), f, flower.aggregate_krum,
                                         to_keep=0)
        _assert_equal(ours, theirs)


def test_bulyan_refuses_what_flower_refuses():
    states, examples = _round(6, np.float64, 0)
    with pytest.raises(ValueError, match="4 \\* num_malicious \\+ 3"):
        flower.aggregate_bulyan(_flower(states, examples), 1, flower.aggregate_krum, to_keep=0)
    with pytest.raises(AggregationError, match="needs at least 7"):
        meshkit.plugins.create("aggregator", "bulyan", {"f": 1}).aggregate(states, examples)
