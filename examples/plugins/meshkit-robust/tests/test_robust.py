"""meshkit-robust's tests: meshkit's contract suite plus what is specific to robust rules."""

from __future__ import annotations

import numpy as np
import pytest

import meshkit_robust
from meshkit import AggregationError, ConfigError
from meshkit.testing import AggregatorContract


class TestMedian(AggregatorContract):
    component = "median"
    plugins = [meshkit_robust]  # test this source tree, whatever else is installed
    weighted = True
    robust = True               # one wild contributor in 40 cannot drag it away
    # With equal weights the weighted median is numpy's median.
    reference = staticmethod(
        lambda values, weights: np.median(np.repeat(values, weights.astype(int), axis=0), axis=0))


class TestTrimmedMean(AggregatorContract):
    component = "trimmed-mean"
    options = {"trim": 0.2}
    plugins = [meshkit_robust]
    weighted = True
    robust = True


class TestUntrimmedMeanIsTheMean(AggregatorContract):
    component = "trimmed-mean"
    options = {"trim": 0.0}
    plugins = [meshkit_robust]
    weighted = True
    reference = staticmethod(lambda values, weights: np.average(values, axis=0, weights=weights))


def _honest_and_poisoned(meshkit_plugins):
    pset = meshkit_plugins(meshkit_robust)
    honest = [{"w": np.full(4, 1.0 + 0.01 * i, np.float32)} for i in range(4)]
    poisoned = {"w": np.full(4, 1e6, np.float32)}
    return pset, honest + [poisoned]


def test_the_median_ignores_a_poisoned_minority(meshkit_plugins):
    pset, states = _honest_and_poisoned(meshkit_plugins)
    result = pset.create("aggregator", "median").aggregate(states)
    assert np.all(result["w"] < 1.1)


def test_the_trimmed_mean_cuts_a_poisoned_minority(meshkit_plugins):
    pset, states = _honest_and_poisoned(meshkit_plugins)
    result = pset.create("aggregator", "trimmed-mean", {"trim": 0.2}).aggregate(states)
    assert np.all(result["w"] < 1.1)


def test_trim_is_checked_when_the_config_is_read(meshkit_plugins):
    pset = meshkit_plugins(meshkit_robust)
    with pytest.raises(ConfigError, match=r"\[aggregator\].*trim must be in \[0, 0.5\)"):
        pset.create("aggregator", "trimmed-mean", {"trim": 0.5})


def test_a_nan_is_refused_not_trimmed_away(meshkit_plugins):
    pset = meshkit_plugins(meshkit_robust)
    states = [{"w": np.ones(3, np.float32)} for _ in range(5)]
    states[3]["w"] = np.array([1.0, np.nan, 1.0], np.float32)
    with pytest.raises(AggregationError, match=r"'w': contributor #3 sent NaN"):
        pset.create("aggregator", "trimmed-mean", {"trim": 0.2}).aggregate(states)
