"""Every built-in outer optimizer passes meshkit's outer optimizer contract suite."""

from __future__ import annotations

import pytest

from meshkit import plugins
from meshkit.testing import OuterOptimizerContract


def _needs(name: str) -> pytest.MarkDecorator:
    present = name in plugins.build_manager().available("outer_optimizer")
    return pytest.mark.skipif(not present, reason=f"outer optimizer {name!r} is not registered")


@_needs("average")
class TestAverage(OuterOptimizerContract):
    component = "average"
    noop_options = {}


@_needs("nesterov")
class TestNesterov(OuterOptimizerContract):
    component = "nesterov"
    noop_options = {"lr": 1.0, "momentum": 0.0}


@_needs("fedavgm")
class TestFedAvgM(OuterOptimizerContract):
    component = "fedavgm"
    noop_options = {"lr": 1.0, "momentum": 0.0}


@_needs("fedadagrad")
class TestFedAdagrad(OuterOptimizerContract):
    component = "fedadagrad"


@_needs("fedadam")
class TestFedAdam(OuterOptimizerContract):
    component = "fedadam"


@_needs("fedadam")
class TestFedAdamWithBiasCorrection(OuterOptimizerContract):
    component = "fedadam"
    options = {"bias_correction": True}


@_needs("fedyogi")
class TestFedYogi(OuterOptimizerContract):
    component = "fedyogi"
