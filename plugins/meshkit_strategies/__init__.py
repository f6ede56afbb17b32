"""Built-in strategies: local, data-parallel, federated, model-parallel, and two refusals.

Only records and options classes live here; the loops (numpy, aggregation)
load when a strategy is built, so listing plugins stays fast.
"""

from __future__ import annotations

from typing import Any, Iterable

import meshkit

from meshkit_strategies.options import (
    DataParallelOptions,
    FederatedOptions,
    LocalOptions,
    ModelParallelOptions,
)


def _build(name: str) -> Any:
    def factory(options: Any = None) -> Any:
        from meshkit_strategies import builtin

        return builtin.build(name, options)

    factory.__name__ = f"build_{name.replace('-', '_')}"
    return factory


@meshkit.hookimpl
def meshkit_strategies() -> Iterable[meshkit.Component]:
    return [
        meshkit.Component("local", _build("local"), LocalOptions,
                          summary="one worker fits the whole training set, round by round"),
        meshkit.Component(
            "data-parallel", _build("data-parallel"), DataParallelOptions,
            summary="replicas compute gradients on their shards; the aggregated gradient is "
                    "applied on every replica"),
        meshkit.Component(
            "federated", _build("federated"), FederatedOptions,
            summary="rounds of client fits folded by the aggregator, stepped by the outer "
                    "optimizer, redistributed"),
        meshkit.Component(
            "model-parallel", _build("model-parallel"), ModelParallelOptions,
            summary="the task's graph split into stages pinned to workers; the activation "
                    "threads stage to stage"),
        meshkit.Component("population-based", _build("population-based"),
                          summary="refused: needs per-member hyperparameters (an executor)"),
        meshkit.Component("custom", _build("custom"),
                          summary="refused: needs a user-provided coordinator"),
    ]
