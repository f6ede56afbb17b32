"""The built-in training strategies pass meshkit's strategy contract suite."""

from __future__ import annotations

from meshkit.testing import StrategyContract


class TestLocal(StrategyContract):
    component = "local"
    options = {"rounds": 2}
    workers = 1


class TestFederated(StrategyContract):
    component = "federated"
    options = {"rounds": 2}


class TestFederatedSampledClients(StrategyContract):
    component = "federated"
    options = {"rounds": 3, "clients": 4, "fraction": 0.5, "min_clients": 1}
    workers = 3


class TestFederatedWithFedYogi(StrategyContract):
    component = "federated"
    options = {"rounds": 2}
    outer_optimizer = "fedyogi"


class TestDataParallel(StrategyContract):
    component = "data-parallel"
    options = {"rounds": 2, "steps": 2, "batch_size": 16}
    aggregator = "allreduce"


class TestModelParallel(StrategyContract):
    """Inference rounds: the model stays the initial one, every round is reported."""

    component = "model-parallel"
    options = {"rounds": 2, "batch_size": 256,
               "partitions": [{"nodes": ["scale", "hidden"], "rank": 1},
                              {"nodes": ["output"], "rank": 2}]}
