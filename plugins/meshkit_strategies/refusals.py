"""``population-based`` and ``custom``: names a user may reach for, refused with the reason.

Each refusal says what the strategy would need and what works instead; a
refusal never falls back to some other loop that would compute a plausible
number.
"""

from __future__ import annotations

from typing import Any, NoReturn

from meshkit import RefusedError


def refuse_population_based(options: Any = None) -> NoReturn:
    # Not a missing loop, a wrong home: each member needs its own
    # hyperparameters applied to its model, and a strategy only sends a
    # shared task to interchangeable workers.
    raise RefusedError(
        "strategy 'population-based' is refused: population-based training is not a "
        "distribution strategy. Each member needs its own hyperparameters applied to "
        "its own model, and a strategy sends one task with one set of options to "
        "interchangeable workers. Run it as an executor instead: launch one meshkit "
        "run per member (each with its own [task] options and out directory) from a "
        "driver script that compares their metrics.jsonl and restarts the losers "
        "with --resume from the winners' checkpoints")


def refuse_custom(options: Any = None) -> NoReturn:
    raise RefusedError(
        "strategy 'custom' is refused: a custom strategy needs a user-provided "
        "coordinator, and this build has none to run. Write a strategy plugin "
        "instead: a meshkit_strategies() hook returning a meshkit.Component whose "
        "factory builds an object with run(ctx: meshkit.StrategyContext) (see "
        "docs/strategies.md), or pick one of local, data-parallel, federated, "
        "model-parallel")
