"""The round skeleton every strategy shares: check stop, clock, play the round, report.

A strategy differs from another only in what it asks the workers to do in
one round: :func:`run_rounds` calls its ``play_round(ctx, rnd, state)`` once
per round, from the round after ``ctx.start_round`` (where a resumed run picks
up) to ``rounds``, and turns each :class:`RoundOutcome` into the
:class:`RoundReport` the runner checkpoints and records. A stop request is
honoured between rounds, never inside one.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping

import attrs

from meshkit.train._strategy import RoundReport, StrategyContext, StrategyResult

__all__ = ["RoundOutcome", "run_rounds", "timed"]


@attrs.frozen
class RoundOutcome:
    """What one round produced: the new global state and what its report says."""

    state: Mapping[str, Any]
    answered: tuple[int, ...]
    dropped: tuple[int, ...] = ()
    clients: tuple[int, ...] = ()
    examples: int = 0
    metrics: Mapping[str, float] = attrs.Factory(dict)


def run_rounds(ctx: StrategyContext, name: str, rounds: int, state: Mapping[str, Any],
               play_round: Callable[[StrategyContext, int, Mapping[str, Any]], RoundOutcome]
               ) -> StrategyResult:
    """Play rounds ``ctx.start_round + 1 .. rounds``, reporting each; the last state wins."""
    metrics: Mapping[str, float] = {}
    for rnd in range(ctx.start_round + 1, rounds + 1):
        ctx.check_stop()
        clock = timed()
        outcome = play_round(ctx, rnd, state)
        state, metrics = outcome.state, outcome.metrics
        ctx.round_completed(RoundReport(
            rnd, rounds, name, answered=outcome.answered, dropped=outcome.dropped,
            clients=outcome.clients, examples=outcome.examples, metrics=metrics,
            seconds=clock()), state)
    return StrategyResult(state, rounds, metrics)


def timed() -> Callable[[], float]:
    """A clock started now: calling it gives the seconds since."""
    start = time.perf_counter()
    return lambda: time.perf_counter() - start
