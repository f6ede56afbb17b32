"""meshkit-robust's tests: meshkit's contract suite plus what is specific to bucketing."""

from __future__ import annotations

import numpy as np
import pytest

import meshkit_robust
from meshkit import ConfigError
from meshkit.testing import AggregatorContract


class TestBucketingOverTheMedian(AggregatorContract):
    component = "bucketing"
    options = {"bucket_size": 2, "inner": "median"}
    plugins = [meshkit_robust]  # this source tree, whatever else is installed
    robust = True               # one wild bucket mean in 20 cannot drag the median away
    bounded = True
    same_in_every_dtype = False  # the shuffle is seeded by the contributions' bytes


class TestBucketingOverTheMeanIsTheMean(AggregatorContract):
    component = "bucketing"
    options = {"bucket_size": 3, "inner": "fedavg"}
    plugins = [meshkit_robust]
    weighted = True
    reference = staticmethod(lambda values, weights: np.average(values, axis=0, weights=weights))


def _honest_and_poisoned(meshkit_plugins, poisoned: int):
    pset = meshkit_plugins(meshkit_robust)
    honest = [{"w": np.full(4, 1.0 + 0.01 * i, np.float32)} for i in range(9)]
    return pset, honest + [{"w": np.full(4, 1e6, np.float32)} for _ in range(poisoned)]


def test_bucketing_keeps_the_median_robust_to_a_poisoned_minority(meshkit_plugins):
    pset, states = _honest_and_poisoned(meshkit_plugins, poisoned=1)
    result = pset.create("aggregator", "bucketing", {"bucket_size": 2}).aggregate(states)
    assert np.all(result["w"] < 1.1)


def test_the_same_round_gives_the_same_buckets_in_any_order(meshkit_plugins):
    pset, states = _honest_and_poisoned(meshkit_plugins, poisoned=2)
    agg = pset.create("aggregator", "bucketing", {"bucket_size": 3})
    first = agg.aggregate(states)
    again = agg.aggregate(states[::-1])
    np.testing.assert_array_equal(first["w"], again["w"])


def test_the_inner_aggregator_is_checked_when_the_config_is_read(meshkit_plugins):
    pset = meshkit_plugins(meshkit_robust)
    with pytest.raises(ConfigError, match=r"\[aggregator\].*inner must name another"):
        pset.create("aggregator", "bucketing", {"inner": "bucketing"})
