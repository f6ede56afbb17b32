"""Everything ``meshkit run`` refuses before any process starts, decided once.

``meshkit run`` calls :func:`build_components` before it binds a socket or
spawns a worker, and ``meshkit check`` calls the same function, so the two
refuse the same configs: a check that says ok to a config the run then
rejects would only move the failure to a worse moment.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from meshkit.errors import ConfigError
from meshkit.task import build_task, check_task

__all__ = ["build_components"]


def build_components(plan: Any) -> dict[str, Any]:
    """Build every component of a resolved plan and run the strategy's own checks.

    Used by ``meshkit run`` before any process starts and by ``meshkit check``,
    so both refuse the same configs.
    """
    cfg = plan.config
    strategy = plan.create("strategy")
    if not callable(getattr(strategy, "run", None)):
        raise ConfigError(f"{cfg.path}: [strategy] {cfg.strategy.name!r} built a "
                          f"{type(strategy).__name__} with no run(ctx) method")
    try:
        task = check_task(build_task(plan.components["task"], plan.options["task"],
                                     cfg.run.task), cfg.run.task)
    except ConfigError as exc:
        raise ConfigError(f"{cfg.path}: [run] task: {exc}") from exc
    check = getattr(strategy, "check", None)
    if callable(check):
        try:
            check(task=task, outer_name=cfg.outer_optimizer.name, workers=cfg.mesh.workers)
        except ConfigError as exc:
            raise ConfigError(f"{cfg.path}: {exc}") from None
    rounds = getattr(getattr(strategy, "options", None), "rounds", 0)
    extra = getattr(strategy, "extra_ranks", None)
    return {
        "boards": list(extra()) if callable(extra) else [],
        "strategy": strategy,
        "task": task,
        "aggregator": plan.create("aggregator"),
        "outer": plan.create("outer_optimizer"),
        "rng": np.random.default_rng(cfg.run.seed),
        "rounds": int(rounds or 0),
        "ctx_state": None,
        "global_state": None,
    }
