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
the round's state before the round starts (unless the strategy's rounds
hand it out themselves, ``hand_state=False``) and named in its report's
``joined``.

A round whose new global model holds a NaN or an infinity is never a
result: with ``on_nonfinite = "stop"`` (the default) the run stops there
with a :class:`meshkit.StateError` naming the keys and the round, before
the round is reported, so the last checkpoint keeps the last finite model;
with ``"skip-round"`` the round keeps the previous global model (sent back
to the live workers, whose replicas may hold the non-finite one) and its
report says so in ``skipped``. A fit that reports non-finite metrics (a
``train_loss`` of NaN: the model diverged, :class:`DivergedFit`) is the
same thing found earlier: ``"stop"`` stops there, ``"skip-round"`` skips
the round.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Mapping

import attrs

from meshkit.errors import StateError
from meshkit.state import nonfinite_keys
from meshkit.train._failures import DivergedFit, RoundFailures, strike
from meshkit.train._pool import wire_bytes
from meshkit.train._strategy import RoundReport, StrategyContext, StrategyResult

__all__ = ["RoundOutcome", "run_rounds", "timed", "ON_NONFINITE"]

#: ``[strategy] on_nonfinite`` values: stop the run, or keep the previous model for the round.
ON_NONFINITE = ("stop", "skip-round")


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
    #: An asynchronous step's staleness histogram, each client's τ and weight, and
    #: the virtual clock (:class:`RoundReport` has their meaning).
    staleness: Mapping[int, int] = attrs.Factory(dict)
    client_staleness: Mapping[int, int] = attrs.Factory(dict)
    client_weights: Mapping[int, float] = attrs.Factory(dict)
    simulated_time: float | None = None
    #: Ranks dropped for the round for their own failure -> the reason (not dead).
    failed: Mapping[int, str] = attrs.Factory(dict)


def run_rounds(ctx: StrategyContext, name: str, rounds: int, state: Mapping[str, Any],
               play_round: Callable[[StrategyContext, int, Mapping[str, Any]], RoundOutcome],
               *, on_nonfinite: str = "stop", hand_state: bool = True,
               accept_failures: bool = True) -> StrategyResult:
    """Play rounds ``ctx.start_round + 1 .. rounds``, reporting each; the last state wins.

    ``on_nonfinite`` is what a round whose new model is not finite does (the
    module docstring): ``"stop"`` or ``"skip-round"``. ``hand_state=False``
    is for a strategy whose rounds hand each worker they use the model
    themselves -- every request carries it and stays outstanding between
    rounds (``fedbuff``), or every round sends its state (``federated``: the
    round engine, the secure round) -- so a joined or skipped-round worker
    is sent no ``set_state`` here, which would be a second copy of the
    model.
    ``accept_failures`` (``[strategy] accept_failures``) is what a member's
    failure costs in every round: its rank for the round, or the run
    (:mod:`meshkit.train._failures`).
    """
    ctx.accept_failures = accept_failures
    if on_nonfinite not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}")
    metrics: Mapping[str, float] = {}
    reported: set[int] = set()
    for rnd in range(ctx.start_round + 1, rounds + 1):
        ctx.check_stop()
        clock = timed()
        joined = tuple(sorted(ctx.admit()))
        for rank in joined:
            ctx.strikes.pop(rank, None)  # a restarted node starts afresh (quarantine)
        ctx.call_failures.clear()
        if joined and hand_state:
            # A replica (data-parallel) or a restarted worker holds no model yet.
            ctx.call([(r, {"op": "set_state", "state": state}) for r in joined])
        counted = wire_bytes(ctx.pool)
        restarts = _restarts(ctx)
        try:
            outcome = play_round(ctx, rnd, state)
        except DivergedFit as exc:
            if on_nonfinite == "stop":
                raise StateError(
                    f"round {rnd}: {exc}; the run stops here and the last checkpoint (round "
                    f"{rnd - 1}) keeps the last finite model") from None
            # Nothing of the round is kept: report it skipped, with the previous model.
            outcome = RoundOutcome(state, answered=(), metrics={})
            diverged = f"a fit diverged ({exc}); kept the round {rnd - 1} model"
        else:
            diverged = ""
        skipped = diverged
        bad = nonfinite_keys(outcome.state)
        if bad:
            shown = ", ".join(map(repr, bad[:5])) + (f" and {len(bad) - 5} more"
                                                      if len(bad) > 5 else "")
            if on_nonfinite == "stop":
                raise StateError(
                    f"round {rnd}: the new global model is not finite (NaN or inf in "
                    f"{shown}); the run stops here and the last checkpoint (round {rnd - 1}) "
                    f"keeps the last finite model. Lower the learning rate (the task's or "
                    f"the outer optimizer's), or set [strategy] on_nonfinite = \"skip-round\" "
                    f"to keep the previous model for such a round")
            skipped = f"non-finite model ({shown}); kept the round {rnd - 1} model"
            # Replicas (data-parallel) hold the model they made: give them the kept one.
            live = ctx.live
            if live and hand_state:
                ctx.broadcast(live, {"op": "set_state", "state": state})
            # The evaluation was of the discarded model: not this round's figures.
            # The clients' training happened; its loss stays when it is finite.
            outcome = attrs.evolve(outcome, state=state, client_metrics={}, metrics={
                k: v for k, v in outcome.metrics.items()
                if k == "train_loss" and math.isfinite(v)})
        after = wire_bytes(ctx.pool)
        state, metrics = outcome.state, outcome.metrics
        if counted is not None and after is not None:
            # Measured by the transport, not computed: every frame of the round, both ways.
            # (Into the report's metrics only: no copy of the 15-field outcome for it.)
            metrics = {**metrics, "bytes_up": float(after[0] - counted[0]),
                       "bytes_down": float(after[1] - counted[1])}
        if ctx.residual_pins is not None:  # [compression] residual = "worker"
            # The clients whose residual's worker was lost this round (meshkit.train._rounds.pins).
            metrics = {**metrics, "residual_restarts": float(_restarts(ctx) - restarts)}
        # Ranks whose reply to a plain request (an evaluation, a replica's step) was an
        # error are this round's failures too; the engine struck its own already.
        called = {r: why for r, why in ctx.call_failures.items() if r not in outcome.failed}
        strike(ctx, RoundFailures(ranks=dict(called)))
        failed = {**called, **outcome.failed}
        partial = _partial_means(outcome)
        dead = set(ctx.dead)
        # A rank taken back and lost again is reported again.
        dropped, reported = tuple(sorted(dead - reported)), dead
        ctx.round_completed(RoundReport(
            rnd, rounds, name, answered=outcome.answered, dropped=dropped,
            clients=outcome.clients, examples=outcome.examples, metrics=metrics,
            seconds=clock(), served=dict(outcome.served),
            not_served=dict(outcome.not_served), late=tuple(outcome.late),
            joined=joined, client_examples=dict(outcome.client_examples),
            client_metrics=dict(outcome.client_metrics), skipped=skipped,
            partial_means=partial, attacked=tuple(outcome.attacked),
            staleness=dict(outcome.staleness), client_staleness=dict(outcome.client_staleness),
            client_weights=dict(outcome.client_weights),
            simulated_time=outcome.simulated_time, failed=failed,
            live=tuple(sorted(ctx.live))), state)
    return StrategyResult(state, rounds, metrics)


def _partial_means(outcome: RoundOutcome) -> str:
    """Say so when the clients behind the round's client means are not its clients.

    While a client's node is down its client is not evaluated, so
    ``client_accuracy`` is a mean over the others and jumps back when it
    rejoins: a row must not read as the same quantity as its neighbours.
    """
    if not outcome.client_metrics:
        return ""
    asked = set(outcome.clients) | set(outcome.not_served)
    evaluated = set(outcome.client_metrics)
    if evaluated >= asked:
        return ""
    missing = ", ".join(map(str, sorted(asked - evaluated)))
    return (f"client means over {len(evaluated & asked)} of {len(asked)} clients "
            f"(not evaluated: {missing})")


def timed() -> Callable[[], float]:
    """A clock started now: calling it gives the seconds since."""
    start = time.perf_counter()
    return lambda: time.perf_counter() - start


def _restarts(ctx: StrategyContext) -> int:
    """Clients restarted from a zero residual so far (``[compression] residual = "worker"``)."""
    return 0 if ctx.residual_pins is None else int(ctx.residual_pins.restarts)
