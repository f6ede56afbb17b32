"""Sharding and client sampling: which rows a client has, which clients a round asks."""

from __future__ import annotations

import numpy as np
import pytest

from meshkit.errors import ConfigError
from meshkit.train import sample_clients, shard_pair


def test_sharding_splits_targets_alongside_inputs():
    x = np.array([[1.0], [2.0], [3.0], [4.0]])
    y = np.array([10.0, 20.0, 30.0, 40.0])
    xs, ys = shard_pair(x, y, 2)
    assert xs[0].tolist() == [[1.0], [2.0]] and ys[0].tolist() == [10.0, 20.0]
    assert xs[1].tolist() == [[3.0], [4.0]] and ys[1].tolist() == [30.0, 40.0]


def test_sharding_refuses_row_counts_that_disagree_naming_both():
    with pytest.raises(ConfigError) as err:
        shard_pair(np.zeros((4, 1)), np.zeros(2), 2)
    assert "4 rows" in str(err.value) and "have 2" in str(err.value)


def test_sharding_without_targets_yields_none_per_shard():
    xs, ys = shard_pair(np.zeros((2, 1)), None, 2)
    assert len(xs) == 2 and ys == [None, None]


def test_the_last_shard_takes_the_remainder_and_too_few_rows_is_refused():
    xs, _ = shard_pair(np.arange(7).reshape(7, 1), None, 3)
    assert [len(s) for s in xs] == [2, 2, 3]
    with pytest.raises(ConfigError, match="cannot split 2 rows into 3 shards"):
        shard_pair(np.zeros((2, 1)), None, 3)


def test_client_sampling_is_seeded_and_respects_min_clients():
    a = [sample_clients(np.random.default_rng(7), 10, 0.3, 1) for _ in range(2)]
    assert a[0] == a[1] and len(a[0]) == 3
    assert len(sample_clients(np.random.default_rng(7), 10, 0.1, 4)) == 4
    assert sample_clients(np.random.default_rng(7), 3, 1.0, 1) == [0, 1, 2]


def test_fraction_sampling_takes_the_documented_ceiling_despite_float_error():
    # 0.07 * 100 == 7.000000000000001 in binary floating point.
    assert len(sample_clients(np.random.default_rng(0), 100, 0.07, 1)) == 7
    assert len(sample_clients(np.random.default_rng(0), 25, 0.28, 1)) == 7
    assert len(sample_clients(np.random.default_rng(0), 10, 0.25, 1)) == 3


def test_a_tiny_fraction_still_samples_at_least_one_client():
    assert len(sample_clients(np.random.default_rng(0), 10, 1e-12, 0)) == 1


def test_poisson_cohort_sizes_fit_binomial_n_q() -> None:
    import math

    from meshkit.train import poisson_clients

    n, q, rounds = 200, 0.05, 3000
    sizes = np.array([len(poisson_clients(11, r, n, q)) for r in range(1, rounds + 1)])
    pmf = np.array([math.comb(n, k) * q ** k * (1 - q) ** (n - k) for k in range(n + 1)])
    # bins <=5, 6 .. 14, >=15 (each expected well above 5): a chi-square test
    edges = [(0, 5), *((k, k) for k in range(6, 15)), (15, n)]
    observed = np.array([((sizes >= a) & (sizes <= b)).sum() for a, b in edges])
    expected = np.array([pmf[a:b + 1].sum() * rounds for a, b in edges])
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 29.59  # the 0.999 quantile with 10 degrees of freedom
    # each client independently: every client's inclusion rate is near q
    counts = np.zeros(n)
    for r in range(1, rounds + 1):
        counts[poisson_clients(11, r, n, q)] += 1
    rate = counts / rounds
    assert np.abs(rate - q).max() < 6 * math.sqrt(q * (1 - q) / rounds)


def test_a_poisson_cohort_is_a_function_of_seed_and_round() -> None:
    from meshkit.train import poisson_clients

    assert poisson_clients(3, 7, 500, 0.1) == poisson_clients(3, 7, 500, 0.1)
    assert poisson_clients(3, 7, 500, 0.1) != poisson_clients(3, 8, 500, 0.1)


def test_sampling_a_cohort_from_ten_million_clients_allocates_no_array_of_them():
    import tracemalloc

    from meshkit.train import poisson_clients

    tracemalloc.start()
    try:
        fixed = sample_clients(np.random.default_rng(0), 10_000_000, 1e-5, 1)
        fixed_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        poisson = poisson_clients(0, 1, 10_000_000, 1e-5)
        poisson_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(fixed) == 100 and fixed_peak < 100_000  # 80 MB if it permuted every client
    assert 50 < len(poisson) < 150 and poisson_peak < 2_000_000


def test_poisson_cohorts_drawn_in_blocks_are_one_draw_of_every_client():
    from meshkit.train import poisson_clients

    rng = np.random.default_rng(np.random.SeedSequence([3, 5, 0x9015]))
    whole = [int(c) for c in np.flatnonzero(rng.random(300_000) < 0.001)]
    assert poisson_clients(3, 5, 300_000, 0.001) == whole
