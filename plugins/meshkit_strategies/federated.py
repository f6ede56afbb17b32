"""``federated``: rounds of client fits, folded by the aggregator, stepped by the outer optimizer."""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from meshkit import ConfigError, MeshError
from meshkit.train import (
    RoundOutcome,
    StrategyContext,
    StrategyResult,
    client_seed,
    run_rounds,
    sample_clients,
)

from meshkit_strategies._shared import train_loss, training_rows
from meshkit_strategies.options import FederatedOptions


@attrs.frozen
class Federated:
    """Rounds of: sample clients, fit each on its shard, fold, outer step, redistribute.

    The new global state travels to the clients with the next round's fit
    request, so redistribution costs no extra message.
    """

    options: FederatedOptions

    def check(self, *, task: Any, outer_name: str, workers: int) -> None:
        """Refuse what cannot work before any process starts."""
        clients = self.options.clients or workers
        if self.options.min_clients > clients:
            raise ConfigError(
                f"[strategy] min_clients = {self.options.min_clients} but there are only "
                f"{clients} clients; lower min_clients or add clients/workers")
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
        # min_clients counts answers, not workers: clients are spread over
        # the live workers round-robin, so one worker can serve several.
        live = ctx.require_live(1, f"round {rnd}")
        sampled = sample_clients(ctx.rng, clients, opts.fraction, opts.min_clients)
        # Clients are spread over the live workers round-robin; a client's
        # fit is seeded by (run seed, round, client), never by its worker.
        requests = [
            (live[i % len(live)], {"op": "fit", "state": state, "shard": c,
                                   "shards": clients, "seed": client_seed(ctx.seed, rnd, c)})
            for i, c in enumerate(sampled)]
        replies = ctx.call(requests)
        answered = [(c, r) for c, r in zip(sampled, replies) if r.ok]
        if len(answered) < opts.min_clients:
            lost = ", ".join(f"rank {r.rank}: {r.error}" for r in replies if not r.ok)
            raise MeshError(
                f"round {rnd}: {len(answered)} of {len(sampled)} clients answered, fewer "
                f"than min_clients = {opts.min_clients} ({lost}). The last checkpoint "
                f"(round {rnd - 1}) is intact; restart the workers and run again with "
                f"--resume")
        # Fold in client order, whatever order answers arrived in, so the
        # float sums (and the final model) are the same run after run.
        fold = ctx.aggregation_begin()
        for c, reply in answered:
            fold.add(reply.payload["state"], float(reply.payload["examples"]),
                     source=f"client {c} (rank {reply.rank})")
        consensus = fold.result()
        state = dict(ctx.outer.step(state, consensus)) if ctx.outer is not None else consensus
        metrics = {**train_loss([r for _, r in answered]), **ctx.task.evaluate(state)}
        return RoundOutcome(
            state,
            answered=tuple(sorted({r.rank for _, r in answered})),
            dropped=tuple(sorted({r.rank for r in replies if not r.ok})),
            clients=tuple(c for c, _ in answered),
            examples=sum(int(r.payload["examples"]) for _, r in answered),
            metrics=metrics)
