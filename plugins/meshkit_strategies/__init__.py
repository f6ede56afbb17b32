"""Built-in strategies: local, data-parallel, federated, fedbuff, diloco, model-parallel, two refusals.

One module per strategy. Only the records, the options classes and the
refusals are imported here; a strategy's loop (numpy, aggregation) loads
when its factory builds it, so listing plugins stays fast.
"""

from __future__ import annotations

from typing import Any, Iterable

import meshkit

from meshkit_strategies.options import (
    DataParallelOptions,
    DiLoCoOptions,
    FedBuffOptions,
    FederatedOptions,
    LocalOptions,
    ModelParallelOptions,
)
from meshkit_strategies.refusals import refuse_custom, refuse_population_based


def build_local(options: LocalOptions | None = None) -> Any:
    from meshkit_strategies.local import Local

    return Local(options or LocalOptions())


def build_data_parallel(options: DataParallelOptions | None = None) -> Any:
    from meshkit_strategies.data_parallel import DataParallel

    return DataParallel(options or DataParallelOptions())


def build_federated(options: FederatedOptions | None = None) -> Any:
    from meshkit_strategies.federated import Federated

    return Federated(options or FederatedOptions())


def build_fedbuff(options: FedBuffOptions | None = None) -> Any:
    from meshkit_strategies.fedbuff import FedBuff

    return FedBuff(options or FedBuffOptions())


def build_diloco(options: DiLoCoOptions | None = None) -> Any:
    from meshkit_strategies.diloco import DiLoCo

    return DiLoCo(options or DiLoCoOptions())


def build_model_parallel(options: ModelParallelOptions | None = None) -> Any:
    from meshkit_strategies.model_parallel import ModelParallel

    strategy = ModelParallel(options or ModelParallelOptions())
    strategy.loaded_state()  # a missing checkpoint fails before anything starts
    return strategy


@meshkit.hookimpl
def meshkit_strategies() -> Iterable[meshkit.Component]:
    return [
        meshkit.Component("local", build_local, LocalOptions,
                          summary="one worker fits the whole training set, round by round"),
        meshkit.Component(
            "data-parallel", build_data_parallel, DataParallelOptions,
            summary="replicas compute gradients on their shards; the aggregated gradient is "
                    "applied on every replica"),
        meshkit.Component(
            "federated", build_federated, FederatedOptions,
            summary="rounds of client fits folded by the aggregator, stepped by the outer "
                    "optimizer, redistributed"),
        meshkit.Component(
            "model-parallel", build_model_parallel, ModelParallelOptions,
            summary="the task's graph split into stages pinned to workers; the activation "
                    "threads stage to stage"),
        meshkit.Component(
            "fedbuff", build_fedbuff, FedBuffOptions,
            summary="asynchronous: clients train on the version they were sent; every "
                    "buffer_size updates, weighted by staleness, step the global model"),
        meshkit.Component(
            "diloco", build_diloco, DiLoCoOptions,
            summary="replicas run inner_steps local steps, then one outer step on the exactly "
                    "averaged (optionally 8/4-bit, fragment-streamed) pseudo-gradients"),
        meshkit.Component("population-based", refuse_population_based,
                          summary="refused: needs per-member hyperparameters (an executor)"),
        meshkit.Component("custom", refuse_custom,
                          summary="refused: needs a user-provided coordinator"),
    ]
