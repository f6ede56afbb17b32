"""Every built-in aggregator passes meshkit's own aggregator contract suite."""

from __future__ import annotations

import numpy as np

from meshkit.aggregation import AggregatorTraits
from meshkit.testing import AggregatorContract


def _mean(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    return np.average(values, axis=0, weights=weights)


class TestFedAvg(AggregatorContract):
    component = "fedavg"
    weighted = True
    reference = staticmethod(_mean)


class TestFedAvgAccumulatingInFloat64(AggregatorContract):
    component = "fedavg"
    options = {"accumulate": "float64"}
    weighted = True
    reference = staticmethod(_mean)


class TestAllReduce(AggregatorContract):
    # An unweighted mean: unequal weights are refused, not silently ignored.
    component = "allreduce"
    weighted = False
    reference = staticmethod(_mean)


class TestFedAvgDeclaredLinear(AggregatorContract):
    """fedavg as the traits engineer's branch declares it: the kit then checks the exact
    weighted mean in every float dtype itself, no `reference` needed."""

    component = "fedavg"

    def make(self, **overrides):
        agg = super().make(**overrides)
        agg.traits = AggregatorTraits(linear=True, needs_individual_updates=False)
        return agg
