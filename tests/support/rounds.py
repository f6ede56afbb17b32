"""In-process rounds for the round engine's tests: a context over LocalPool workers, fits, bytes."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

import meshkit.plugins
from meshkit.train import LocalPool, StrategyContext, Work, client_seed

SYNTHETIC = {"params": 4096, "arrays": 2, "rows": 256}


def synthetic() -> Any:
    return meshkit.plugins.create("task", "synthetic", SYNTHETIC)


def make_ctx(workers: int = 4, fail: Callable[..., Any] | None = None, order: Any = None,
             aggregator: str = "fedavg", task: Callable[[], Any] = synthetic,
             inline_bytes: int | None = 0) -> StrategyContext:
    """``inline_bytes`` defaults to 0 here: these small models' results then wait on their
    workers and are pulled (``take``) as a large model's are, so the tests of keeping,
    taking and losing a held result exercise it; ``None`` is the engine's default
    (``INLINE_BYTES``: a small model's results come back with their fits)."""
    ranks = list(range(1, workers + 1))
    return StrategyContext(
        task=task(), aggregator=meshkit.plugins.create("aggregator", aggregator),
        pool=LocalPool.of(task, ranks, fail=fail, order=order), workers=ranks,
        rng=np.random.default_rng(0),
        outer=meshkit.plugins.create("outer_optimizer", "average"), timeout=30.0,
        inline_bytes=inline_bytes)


def fits(clients: int, rnd: int = 1, shards: int | None = None) -> list[Work]:
    return [Work(c, {"op": "fit", "shard": c, "shards": shards or clients,
                     "seed": client_seed(7, rnd, c)}) for c in range(clients)]


def same_bytes(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        np.array_equal(np.frombuffer(a[k].tobytes(), np.uint8),
                       np.frombuffer(b[k].tobytes(), np.uint8)) for k in a)
