"""``local``: one worker fits the whole training set, round by round; no aggregation."""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from meshkit import MeshError
from meshkit.train import RoundOutcome, StrategyContext, StrategyResult, client_seed, run_rounds

from meshkit_strategies._shared import train_loss
from meshkit_strategies.options import LocalOptions


@attrs.frozen
class Local:
    """One worker, the whole training set, ``rounds`` fits; no aggregation at all."""

    options: LocalOptions

    def run(self, ctx: StrategyContext) -> StrategyResult:
        return run_rounds(ctx, "local", self.options.rounds, ctx.initial_state(),
                          self.play_round)

    def play_round(self, ctx: StrategyContext, rnd: int,
                   state: Mapping[str, Any]) -> RoundOutcome:
        rank = ctx.require_live(1, f"round {rnd}")[0]
        reply = ctx.call([(rank, {"op": "fit", "state": state, "shard": 0, "shards": 1,
                                  "seed": client_seed(ctx.seed, rnd, 0)})])[0]
        if not reply.ok:
            ctx.require_live(1, f"round {rnd}")
            raise MeshError(f"round {rnd}: rank {rank} did not answer: {reply.error}")
        fitted = dict(reply.payload["state"])
        # docs/strategies.md: the outer optimizer steps the global model
        # from the fit's result (average adopts it).
        state = dict(ctx.outer.step(state, fitted)) if ctx.outer is not None else fitted
        metrics = {**train_loss([reply]), **ctx.task.evaluate(state)}
        return RoundOutcome(state, answered=(rank,), clients=(0,),
                            examples=int(reply.payload["examples"]), metrics=metrics)
