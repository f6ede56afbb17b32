"""The robust built-ins pass both contract suites (meshkit.testing).

Krum, Multi-Krum and Bulyan need more contributors than the general
suite's small rounds (one, two, five), so they run the robust suite only.
"""

from __future__ import annotations

import numpy as np

from meshkit.testing import AggregatorContract, RobustAggregatorContract


class TestMedianContract(AggregatorContract):
    component = "median"
    robust = True
    reference = staticmethod(lambda values, weights: np.median(values, axis=0))


class TestMedianRobust(RobustAggregatorContract):
    component = "median"
    rule = "median"


class TestTrimmedMeanContract(AggregatorContract):
    component = "trimmed-mean"
    robust = True


class TestTrimmedMeanRobust(RobustAggregatorContract):
    component = "trimmed-mean"
    rule = "trimmed-mean"


class TestTrimmedMeanTenPercentRobust(RobustAggregatorContract):
    component = "trimmed-mean"
    options = {"beta": 0.1}
    rule = "trimmed-mean"


class TestKrumRobust(RobustAggregatorContract):
    component = "krum"
    options = {"f": 2}
    rule = "krum"


class TestMultiKrumRobust(RobustAggregatorContract):
    component = "multi-krum"
    options = {"f": 1, "m": 3}
    rule = "multi-krum"


class TestMultiKrumDefaultM(RobustAggregatorContract):
    component = "multi-krum"
    options = {"f": 2}
    rule = "multi-krum"


class TestBulyanRobust(RobustAggregatorContract):
    component = "bulyan"
    options = {"f": 2}
    rule = "bulyan"


class TestGeometricMedianContract(AggregatorContract):
    component = "geometric-median"
    robust = True  # and unweighted: a claimed example count does not buy the round


class TestGeometricMedianRobust(RobustAggregatorContract):
    component = "geometric-median"
    rule = "geometric-median"


class TestCenteredClippingRobust(RobustAggregatorContract):
    component = "centered-clipping"
    options = {"tau": 2.0, "iterations": 2}
    rule = "centered-clipping"


class TestNormBoundContract(AggregatorContract):
    component = "norm-bound"
    options = {"max_norm": 1e9}   # nothing clipped: fedavg's weighted mean
    weighted = True
    reference = staticmethod(lambda values, weights: np.average(values, axis=0, weights=weights))


class TestNormBoundClipping(AggregatorContract):
    """Clipping on: every update is clipped (the kit's contributions have norms near 4).

    The kit passes the round's reference (norm-bound uses it), checks identity
    at the reference, not one contributor back unchanged, and that updates are
    measured from the reference.
    """

    component = "norm-bound"
    options = {"max_norm": 1.0}
    weighted = True


class TestNormBoundRobust(RobustAggregatorContract):
    component = "norm-bound"
    options = {"max_norm": 1.0}
    rule = "norm-bound"
