"""The round skeleton every strategy shares: check stop, clock, play the round, report.

A strategy differs from another only in what it asks the workers to do in
one round: :func:`run_rounds` calls its ``play_round(ctx, rnd, state)`` once
per round, from the round after ``ctx.start_round`` (where a resumed run picks
up) to ``rounds``, and turns each :class:`RoundOutcome` into the
:class:`RoundReport` the runner checkpoints and records. Who was dropped is
read from the dead ledger here, not reported by the strategy: each report
names the workers declared dead since the report before it (between rounds
or during this one). A stop request is honoured between rounds, never
inside one, and so is a worker coming in (``ctx.admit()``: a late joiner,
or a restarted worker taken back from the dead ledger), which is handed
the round's state before the round starts and named in its report's
``joined``.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping

import attrs

from meshkit.train._strategy import RoundReport, StrategyContext, StrategyResult

__all__ = ["RoundOutcome", "run_rounds", "timed"]


@attrs.frozen
class RoundOutcome:
    """What one round produced: the new global state and what its report says.

    ``served`` maps each folded client to the rank that served it and
    ``not_served`` each client the round could not fold to the reason
    (:meth:`meshkit.train.Folded.outcome` fills both from the engine).
    """

    state: Mapping[str, Any]
    answered: tuple[int, ...]
    clients: tuple[int, ...] = ()
    examples: int = 0
    metrics: Mapping[str, float] = attrs.Factory(dict)
    served: Mapping[int, int] = attrs.Factory(dict)
    not_served: Mapping[int, str] = attrs.Factory(dict)
    #: Examples each folded client trained on (its fedavg weight).
    client_examples: Mapping[int, int] = attrs.Factory(dict)
    #: Each client's own evaluation of the new global model (``evaluate = "clients"``).
    client_metrics: Mapping[int, Mapping[str, float]] = attrs.Factory(dict)
    #: Ranks whose answer missed the round deadline (they are not dead).
    late: tuple[int, ...] = ()
    #: Clients whose contribution was attacked (``[attack]``, ``meshkit node --attack``).
    attacked: tuple[int, ...] = ()


def run_rounds(ctx: StrategyContext, name: str, rounds: int, state: Mapping[str, Any],
               play_round: Callable[[StrategyContext, int, Mapping[str, Any]], RoundOutcome]
               ) -> StrategyResult:
    """Play rounds ``ctx.start_round + 1 .. rounds``, reporting each; the last state wins."""
    metrics: Mapping[str, float] = {}
    reported: set[int] = set()
    for rnd in range(ctx.start_round + 1, rounds + 1):
        ctx.check_stop()
        clock = timed()
        joined = tuple(sorted(ctx.admit()))
        if joined:
            # A replica (data-parallel) or a restarted worker holds no model yet.
            ctx.call([(r, {"op": "set_state", "state": state}) for r in joined])
        outcome = play_round(ctx, rnd, state)
        state, metrics = outcome.state, outcome.metrics
        dead = set(ctx.dead)
        # A rank taken back and lost again is reported again.
        dropped, reported = tuple(sorted(dead - reported)), dead
        ctx.round_completed(RoundReport(
            rnd, rounds, name, answered=outcome.answered, dropped=dropped,
            clients=outcome.clients, examples=outcome.examples, metrics=metrics,
            seconds=clock(), served=dict(outcome.served),
            not_served=dict(outcome.not_served), late=tuple(outcome.late),
            joined=joined, client_examples=dict(outcome.client_examples),
            client_metrics=dict(outcome.client_metrics),
            attacked=tuple(outcome.attacked)), state)
    return StrategyResult(state, rounds, metrics)


def timed() -> Callable[[], float]:
    """A clock started now: calling it gives the seconds since."""
    start = time.perf_counter()
    return lambda: time.perf_counter() - start
