"""The robust built-ins on hand-computed rounds (always; flwr or not), and their refusals."""

from __future__ import annotations

import numpy as np
import pytest

import meshkit
from meshkit import AggregationError, ConfigError
from meshkit.aggregation import begin, holds_every_contribution


def agg(name: str, **options):
    return meshkit.plugins.create("aggregator", name, options)


def rows(*values) -> list[dict]:
    return [{"w": np.atleast_1d(np.asarray(v, dtype=np.float64))} for v in values]


def result(aggregator, states, weights=None, **kw):
    return aggregator.aggregate(states, weights, **kw)["w"]


def test_median_of_an_even_count_is_the_mean_of_the_middle_two():
    np.testing.assert_array_equal(result(agg("median"), rows(20, 1, 10, 2)), [6.0])
    np.testing.assert_array_equal(result(agg("median"), rows(20, 1, 10, 2, 3)), [3.0])


def test_median_counts_each_contributor_once_whatever_its_weight():
    np.testing.assert_array_equal(result(agg("median"), rows(0, 1, 100), [1, 1, 1000]), [1.0])


def test_trimmed_mean_cuts_floor_beta_n_after_sorting():
    # beta 0.2 of 5: one cut from each end, after sorting: mean(2, 3, 4).
    np.testing.assert_allclose(result(agg("trimmed-mean"), rows(100, 2, -50, 3, 4)), [3.0])
    # beta 0.2 of 4 cuts nothing (floor(0.8) = 0), as Flower: the plain mean.
    np.testing.assert_allclose(result(agg("trimmed-mean"), rows(1, 2, 3, 10)), [4.0])


def test_krum_picks_the_point_nearest_its_n_minus_f_minus_2_neighbours():
    # n = 5, f = 1: two neighbours. Scores (squared): 0:5, 1:2, 2:2, 3:5, 100: huge;
    # 1 and 2 tie, and the tie goes to the smaller contribution.
    np.testing.assert_array_equal(result(agg("krum", f=1), rows(3, 100, 2, 0, 1)), [1.0])


def test_multi_krum_averages_the_m_best_weighted_by_examples():
    got = result(agg("multi-krum", f=1, m=2), rows(0, 1, 2, 3, 100), [1, 1, 3, 1, 1])
    np.testing.assert_allclose(got, [(1 * 1 + 2 * 3) / 4])


def test_bulyan_selects_by_krum_then_averages_around_the_median():
    # n = 7, f = 1: Krum picks 2, 3, 1, 4, 0 in turn (the outlier never);
    # median 2, the beta = 3 values nearest it are 1, 2, 3.
    np.testing.assert_allclose(result(agg("bulyan", f=1), rows(5, 100, 0, 4, 1, 3, 2)), [2.0])


def test_geometric_median_of_points_on_a_line_is_their_median():
    np.testing.assert_allclose(result(agg("geometric-median"), rows(0, 1, 10)), [1.0],
                               atol=1e-4)
    # Each contributor counts once: claiming 5x the work at 10 does not move it there.
    np.testing.assert_allclose(result(agg("geometric-median", max_iter=1000),
                                      rows(0, 1, 10), [1, 1, 5]), [1.0], atol=1e-4)


def test_centered_clipping_carries_its_centre_from_round_to_round():
    cc = agg("centered-clipping", tau=1.0, iterations=1)
    reference = {"w": np.array([10.0, 10.0])}
    round_ = [{"w": np.array([13.0, 14.0])}, {"w": np.array([10.3, 10.4])}]
    # Round 1 from centre 0: updates (3, 4) clipped to (0.6, 0.8), (0.3, 0.4) kept.
    np.testing.assert_allclose(result(cc, round_, reference=reference), [10.45, 10.6])
    # Round 2 from centre (0.45, 0.6): (2.55, 3.4) clipped to (0.6, 0.8); (-0.15, -0.2)
    # kept; the centre moves by their mean (0.225, 0.3).
    np.testing.assert_allclose(result(cc, round_, reference=reference), [10.675, 10.9])
    assert set(cc.state_dict()) == {"centre"}


def test_norm_bound_clips_each_update_then_takes_fedavgs_mean():
    nb = agg("norm-bound", max_norm=1.0)
    reference = {"w": np.array([1.0, 1.0])}
    states = [{"w": np.array([4.0, 5.0])}, {"w": np.array([1.3, 1.4])}]
    expected = [(1.6 + 3 * 1.3) / 4, (1.8 + 3 * 1.4) / 4]
    np.testing.assert_allclose(result(nb, states, [1, 3], reference=reference), expected)
    fold = begin(nb, reference=reference)
    for state, weight in zip(states, [1, 3]):
        fold.add(state, weight)
    np.testing.assert_allclose(fold.result()["w"], expected)


def test_only_norm_bound_streams():
    streaming = {n for n in ("median", "trimmed-mean", "krum", "multi-krum", "bulyan",
                             "geometric-median", "centered-clipping", "norm-bound")
                 if not holds_every_contribution(agg(n, **{"norm-bound": {"max_norm": 1.0},
                                                           "multi-krum": {"f": 1},
                                                           "bulyan": {"f": 1}}.get(n, {})))}
    assert streaming == {"norm-bound"}


@pytest.mark.parametrize("name,options,n,needed", [
    ("krum", {"f": 2}, 6, 7), ("multi-krum", {"f": 1}, 4, 5), ("bulyan", {"f": 1}, 6, 7),
    ("bulyan", {"f": 2}, 10, 11),
])
def test_too_few_contributors_are_refused_saying_how_many(name, options, n, needed):
    with pytest.raises(AggregationError, match=f"{n} contributor\\(s\\) this round, but it "
                                               f"needs at least {needed}"):
        agg(name, **options).aggregate(rows(*range(n)))


def test_multi_krum_refuses_to_average_more_than_it_has():
    with pytest.raises(AggregationError, match="m = 9 contributions to average, but only 5"):
        agg("multi-krum", f=1, m=9).aggregate(rows(*range(5)))


def test_a_non_finite_contribution_is_refused_naming_it():
    with pytest.raises(AggregationError, match="contributor #1 has non-finite values in 'w'"):
        agg("median").aggregate(rows(1.0, np.nan, 2.0))


def test_integer_arrays_and_json_leaves_follow_the_strict_mean():
    states = [{"w": np.array([float(v)], np.float32), "steps": np.array(7, np.int64),
               "meta": {"lr": 0.1}} for v in (1, 5, 9)]
    out = agg("median").aggregate(states)
    assert out["w"].dtype == np.float32 and out["w"][0] == 5.0
    assert out["steps"] == 7 and out["steps"].dtype == np.int64 and out["meta"] == {"lr": 0.1}


@pytest.mark.parametrize("name,options,message", [
    ("trimmed-mean", {"beta": 0.5}, "beta .* must be in \\[0, 0.5\\)"),
    ("krum", {"f": -1}, "f must be an integer >= 0"),
    ("geometric-median", {"eps": 0}, "eps must be a finite number > 0"),
    ("centered-clipping", {"tau": -1.0}, "tau must be a finite number > 0"),
])
def test_bad_options_are_config_errors(name, options, message):
    with pytest.raises(ConfigError, match=message):
        agg(name, **options)


def test_norm_bound_needs_its_max_norm():
    with pytest.raises(ConfigError, match="max_norm"):
        agg("norm-bound")


@pytest.mark.parametrize("name, options", [("multi-krum", {}), ("multi-krum", {"f": 0, "m": 0}),
                                           ("bulyan", {}), ("bulyan", {"f": 0})])
def test_a_rule_whose_options_make_it_the_plain_mean_is_refused(name, options):
    # multi-krum with f = 0, m = 0 and bulyan with f = 0 keep and average every
    # contribution: fedavg under a robust rule's name (issue 35, item 3).
    with pytest.raises(meshkit.ConfigError, match=r"f must be at least 1"):
        meshkit.plugins.create("aggregator", name, options)


def test_multi_krum_with_f_0_and_an_explicit_m_still_selects():
    # n - 2 = 3 neighbours: 1 and 2 score 6, 0 and 3 score 14; the two best averaged.
    np.testing.assert_allclose(result(agg("multi-krum", m=2), rows(0, 1, 2, 3, 100)), [1.5])
