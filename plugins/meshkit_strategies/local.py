"""``local``: one worker fits the whole training set, round by round; no aggregation."""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from meshkit import MeshError
from meshkit.train import RoundOutcome, StrategyContext, StrategyResult, StrategyTraits, Work
from meshkit.train import client_seed, fold_round, run_rounds

from meshkit_strategies.options import LocalOptions


class _Adopt:
    """The "fold" of a single fit: the fit itself (local aggregates nothing)."""

    def __init__(self) -> None:
        self.state: dict[str, Any] | None = None

    def add(self, state: Mapping[str, Any], weight: float = 1.0, *,
            source: str | None = None) -> None:
        self.state = dict(state)

    def result(self) -> dict[str, Any]:
        assert self.state is not None
        return self.state


@attrs.frozen
class Local:
    """One worker, the whole training set, ``rounds`` fits; no aggregation at all.

    The fit runs on a live worker through the round engine, so a worker lost
    mid-fit is replaced by the next live one in the same round.
    """

    options: LocalOptions

    @property
    def traits(self) -> StrategyTraits:
        """One worker's fits: no clients, nothing private, secure, clocked or collective."""
        return StrategyTraits(rounds=self.options.rounds)

    def run(self, ctx: StrategyContext) -> StrategyResult:
        return run_rounds(ctx, "local", self.options.rounds, ctx.initial_state(),
                          self.play_round,
                          on_nonfinite=self.options.on_nonfinite)

    def play_round(self, ctx: StrategyContext, rnd: int,
                   state: Mapping[str, Any]) -> RoundOutcome:
        ctx.require_live(1, f"round {rnd}")
        work = [Work(0, {"op": "fit", "shard": 0, "shards": 1,
                         "seed": client_seed(ctx.seed, rnd, 0)})]
        folded = fold_round(ctx, work, state=state, fold=_Adopt())
        if folded.result is None:
            ctx.require_live(1, f"round {rnd}")
            raise MeshError(f"round {rnd}: the fit was not served: {folded.not_served[0]}")
        # docs/strategies.md: the outer optimizer steps the global model
        # from the fit's result (average adopts it).
        fitted = folded.result
        state = ctx.outer_step(state, fitted)
        return folded.outcome(state, {**folded.train_loss(), **ctx.task.evaluate(state)})
