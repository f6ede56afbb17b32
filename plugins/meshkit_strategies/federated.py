"""``federated``: rounds of client fits, folded by the aggregator, stepped by the outer optimizer."""

from __future__ import annotations

import inspect
from typing import Any, Mapping

import attrs

from meshkit import ConfigError, MeshError
from meshkit.train import RoundOutcome, StrategyContext, StrategyResult, Work
from meshkit.train import client_seed, fold_round, run_rounds, sample_clients

from meshkit_strategies._shared import training_rows
from meshkit_strategies.options import FederatedOptions


@attrs.frozen
class Federated:
    """Rounds of: sample clients, fit each on its shard, fold, outer step, redistribute.

    The round engine (:func:`meshkit.train.fold_round`) sends the global
    state once to each worker the round needs, hands the sampled clients to
    live workers and folds their fits in client order as it pulls them.
    """

    options: FederatedOptions

    def check(self, *, task: Any, outer_name: str, workers: int) -> None:
        """Refuse what cannot work before any process starts."""
        clients = self.options.clients or workers
        if self.options.min_clients > clients:
            raise ConfigError(
                f"[strategy] min_clients = {self.options.min_clients} but there are only "
                f"{clients} clients; lower min_clients or add clients/workers")
        if self.options.time_budget and not _takes_time_budget(task):
            raise ConfigError(
                f"[strategy] time_budget = {self.options.time_budget:g}: the task "
                f"({type(task).__name__}) cannot honour a time budget: its fit() takes no "
                f"time_budget argument (docs/tasks.md). Drop time_budget, or give fit() a "
                f"time_budget keyword and stop when it runs out")
        rows = training_rows(task)
        if rows is not None and rows < clients:
            raise ConfigError(
                f"[strategy] clients = {clients} but the task has only {rows} training rows; "
                f"every client's shard needs at least one row. Use at most {rows} clients")

    def run(self, ctx: StrategyContext) -> StrategyResult:
        self.check(task=ctx.task, outer_name=ctx.outer_name, workers=len(ctx.workers))
        return run_rounds(ctx, "federated", self.options.rounds, ctx.initial_state(),
                          self.play_round)

    def play_round(self, ctx: StrategyContext, rnd: int,
                   state: Mapping[str, Any]) -> RoundOutcome:
        opts = self.options
        clients = opts.clients or len(ctx.workers)
        sampled = sample_clients(ctx.rng, clients, opts.fraction, opts.min_clients)
        # A client's fit is seeded by (run seed, round, client), never by the
        # worker that serves it: any live worker gives the same contribution.
        budget = {"time_budget": opts.time_budget} if opts.time_budget else {}
        work = [Work(c, {"op": "fit", "shard": c, "shards": clients,
                         "seed": client_seed(ctx.seed, rnd, c), **budget}) for c in sampled]
        folded = fold_round(ctx, work, state=state, window=opts.window,
                            deadline=opts.round_timeout or None)
        # min_clients counts served clients, not workers: one live worker
        # may serve every client of a round.
        if len(folded.served) < opts.min_clients:
            missing = "; ".join(f"client {c}: {why}" for c, why in folded.not_served.items())
            raise MeshError(
                f"round {rnd}: {len(folded.served)} of {len(sampled)} clients served, fewer "
                f"than min_clients = {opts.min_clients} (not served: {missing or 'none'}). "
                f"The last checkpoint (round {rnd - 1}) is intact; restart the workers and "
                f"run again with --resume")
        consensus = folded.result
        state = dict(ctx.outer.step(state, consensus)) if ctx.outer is not None else consensus
        return folded.outcome(state, {**folded.train_loss(), **ctx.task.evaluate(state)})


def _takes_time_budget(task: Any) -> bool:
    """Whether ``task.fit`` accepts a ``time_budget`` keyword (how a task says it honours one)."""
    try:
        parameters = inspect.signature(task.fit).parameters
    except (TypeError, ValueError):
        return False
    return "time_budget" in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
