"""``data-parallel``: synchronous SGD, one averaged gradient applied on every replica per step."""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from meshkit import ConfigError, MeshError, ProtocolError
from meshkit.train import Reply, RoundOutcome, StrategyContext, StrategyResult, StrategyTraits, Work
from meshkit.train import check_contribution, client_seed, fold_round, once, run_rounds
from meshkit.train import signature, train_loss

from meshkit_strategies._shared import require_replica_task
from meshkit_strategies.options import DataParallelOptions


@attrs.define
class Replicas:
    """The ranks that acknowledged the model the replicas hold now (a run's, mutable).

    A rank becomes a replica only by answering a ``set_state`` of that model
    (or an ``apply`` on it): one that is live without having done so (its
    link came up after the model was sent, or the reply was lost) is handed
    the model before it is sent a step, and one whose answer was lost is
    declared dead, so no replica is ever asked to step a model it lacks.
    """

    held: set[int] = attrs.Factory(set)

    def deliver(self, ctx: StrategyContext, ranks: list[int], request: Mapping[str, Any], *,
                everyone: bool) -> None:
        """Send ``request`` (``set_state`` or ``apply``) to ``ranks``; the ones that answered
        hold the model now. ``everyone``: the replicas' model changes, so a rank it did not
        reach holds it no longer."""
        replies = ctx.broadcast(ranks, request)
        if everyone:
            self.held.clear()
        for reply in replies:
            self._acknowledged(ctx, reply, str(request["op"]))

    def _acknowledged(self, ctx: StrategyContext, reply: Reply, op: str) -> None:
        if reply.ok:
            self.held.add(reply.rank)
            return
        self.held.discard(reply.rank)
        # A lost answer: the rank may or may not hold the model, so it is
        # not a replica. The pool declares most losses itself; not a host
        # relay's "did not answer for rank N" (the relay's news comes later).
        ctx.pool.declare_dead(reply.rank, f"did not acknowledge the replicas' model "
                                          f"({op}): {reply.error}")


@attrs.frozen
class DataParallel:
    """Synchronous SGD: every step, replicas compute gradients of their shard's
    minibatch, the round engine folds them in shard order, and every replica
    applies the same average. A replica lost mid-step has its shard
    recomputed by a live one in the same step (replicas are bit-identical,
    so the step's mean is unchanged); later steps shard over the survivors.
    The round's state is read back from a replica *after* the step, so the
    training just done is what is returned.

    On a mesh (``ctx.peer_reduce``: the tcp mesh, or ``torchdist``) the
    replicas average their gradients among themselves with
    ``group.mesh_all_reduce`` (the trainer's ``step``), so the coordinator
    neither receives nor folds a gradient. There a replica lost mid-step
    fails the step on every replica (a collective has no survivors' mean):
    the run stops, and ``--resume`` continues from the last checkpoint.

    The outer optimizer steps once per round (DiLoCo: ``steps`` inner steps,
    then an outer step): the replicas' common model after the round is the
    consensus, the model they started the round from the global one. With
    ``average`` the replicas carry on as they are; any other optimizer's new
    global model is sent to every replica (``set_state``), which starts its
    inner optimizer afresh from it (docs/strategies.md)."""

    options: DataParallelOptions

    @property
    def traits(self) -> StrategyTraits:
        """Replicas, not clients: nothing private, secure, clocked or collective."""
        return StrategyTraits(rounds=self.options.rounds, device=self.options.device,
                              check=self.check, accept_failures=self.options.accept_failures)

    def check(self, *, task: Any, outer_name: str, workers: int) -> None:
        """Refuse what cannot work before any process starts."""
        if self.options.min_workers > workers:
            raise ConfigError(
                f"[strategy] min_workers = {self.options.min_workers} but there are only "
                f"{workers} workers; lower min_workers or add workers")
        require_replica_task(task, workers, "data-parallel",
                             "every step is the task's gradients, averaged, then apply")

    def run(self, ctx: StrategyContext) -> StrategyResult:
        opts = self.options
        self.check(task=ctx.task, outer_name=ctx.outer_name if ctx.outer is not None
                   else "average", workers=len(ctx.workers))
        state = ctx.initial_state()
        live = ctx.require_live(opts.min_workers, "start")
        replicas = Replicas()
        replicas.deliver(ctx, live, {"op": "set_state", "state": state}, everyone=True)

        def play_round(ctx: StrategyContext, rnd: int,
                       state: Mapping[str, Any]) -> RoundOutcome:
            return self.play_round(ctx, rnd, state, replicas)

        return run_rounds(ctx, "data-parallel", opts.rounds, state, play_round,
                          on_nonfinite=self.options.on_nonfinite,
                          accept_failures=self.options.accept_failures)

    def play_round(self, ctx: StrategyContext, rnd: int, state: Mapping[str, Any],
                   replicas: Replicas | None = None) -> RoundOutcome:
        """One round of ``steps`` steps from ``state``, which ``replicas`` hold (None: none
        is known to, so every live rank is sent it first)."""
        opts = self.options
        replicas = Replicas() if replicas is None else replicas
        answered: set[int] = set()
        examples = 0
        replies: list[Mapping[str, Any]] = []
        served: dict[int, int] = {}
        failed: dict[int, str] = {}  # ranks that sat out a step for their own failure
        for step in range(opts.steps):
            live = self._replicas(ctx, replicas, state, step, f"round {rnd} step {step + 1}")
            global_step = (rnd - 1) * opts.steps + step
            if ctx.peer_reduce:
                stepped = self._mesh_step(ctx, live, global_step, f"round {rnd} step {step + 1}")
                replicas.held = set(live)  # every one of them stepped (or the run stopped)
                answered.update(live)
                examples += sum(int(p.get("examples", 0)) for p in stepped)
                served = dict(enumerate(live))
                replies.extend(stepped)
                continue
            work = [Work(i, {"op": "grads", "shard": i, "shards": len(live),
                             "batch_size": opts.batch_size,
                             "seed": client_seed(ctx.seed, global_step, i)})
                    for i in range(len(live))]
            # Each replica's gradients have the model's keys, shapes and dtypes:
            # one that does not is its rank's protocol error, not the step's.
            folded = fold_round(ctx, work, weight=once, window=opts.window, label="shard",
                                reference=state)
            if folded.not_served:
                # Every shard or none: a mean over fewer shards is another step.
                ctx.require_live(opts.min_workers, f"round {rnd} step {step + 1}")
                raise MeshError(f"round {rnd} step {step + 1}: shards not served: "
                                f"{folded.not_served}")
            # The step happens here, on every live replica, on the same mean
            # (sent once per host relay when the replicas are behind relays).
            replicas.deliver(ctx, [r for r in ctx.live if r in replicas.held],
                             {"op": "apply", "gradients": folded.result}, everyone=True)
            answered.update(folded.answered)
            for rank, why in folded.failed.items():
                failed.setdefault(rank, why)
            examples += folded.examples
            served = folded.served
            replies.extend(folded.replies.values())
        reader = self._reader(ctx, replicas, f"round {rnd}")
        outcome = self._read_back(ctx, rnd, reader, answered, examples, replies, served,
                                  state, replicas)
        return attrs.evolve(outcome, failed=failed)

    def _replicas(self, ctx: StrategyContext, replicas: Replicas, state: Mapping[str, Any],
                  step: int, label: str) -> list[int]:
        """The live ranks for a step, each holding the replicas' model: a live rank that
        does not is sent it first (the round's ``state`` at its first step, else the
        replicas' model read back from one of them)."""
        for _ in range(len(ctx.workers) + 1):  # bounded: each pass takes in the new ranks
            live = ctx.require_live(self.options.min_workers, label)
            fresh = [r for r in live if r not in replicas.held]
            if not fresh:
                return live
            now = state if step == 0 else self._model_now(ctx, replicas, state, label)
            # The replicas start no inner optimizer afresh; the newcomer does, as a
            # rank admitted between rounds does (docs/strategies.md).
            replicas.deliver(ctx, fresh, {"op": "set_state", "state": now}, everyone=False)
        raise MeshError(f"{label}: ranks kept joining while the replicas' model was sent to "
                        f"them; live: {ctx.live}, holding the model: {sorted(replicas.held)}")

    def _reader(self, ctx: StrategyContext, replicas: Replicas, label: str) -> int:
        """The first live replica holding the model (a rank live since the last step is not)."""
        live = ctx.require_live(self.options.min_workers, label)
        held = [r for r in live if r in replicas.held]
        if not held:
            raise MeshError(f"{label}: no live rank holds the replicas' model (live: {live})")
        return held[0]

    def _model_now(self, ctx: StrategyContext, replicas: Replicas, state: Mapping[str, Any],
                   label: str) -> Mapping[str, Any]:
        """The model the replicas hold mid-round, read back from one of them; one whose
        model lacks the round's keys, shapes and dtypes is its protocol error."""
        expected = signature(state)
        for reader in [r for r in ctx.live if r in replicas.held]:
            reply = ctx.call([(reader, {"op": "get_state"})])[0]
            replicas.held.discard(reader)  # kept only when its model is handed on
            if reply.payload is None:
                continue  # lost: the pool declared it dead
            try:
                check_contribution(reply.payload["state"], expected, f"rank {reader}'s model")
            except ProtocolError as exc:
                ctx.pool.declare_dead(reader, f"protocol error: {exc}")
                continue
            replicas.held.add(reader)
            return dict(reply.payload["state"])
        raise MeshError(f"{label}: no replica holds the model to hand a newly live rank "
                        f"(live: {ctx.live})")

    def _mesh_step(self, ctx: StrategyContext, live: list[int], global_step: int,
                   label: str) -> list[Mapping[str, Any]]:
        """One step on a mesh: every live replica all-reduces its shard's gradients and applies."""
        opts = self.options
        replies = ctx.call([(r, {"op": "step", "shard": i, "shards": len(live),
                                 "batch_size": opts.batch_size, "ranks": list(live),
                                 "seed": client_seed(ctx.seed, global_step, i)})
                            for i, r in enumerate(live)])
        lost = {reply.rank: reply.error for reply in replies if not reply.ok}
        if lost:
            why = "; ".join(f"rank {r}: {error}" for r, error in lost.items())
            raise MeshError(
                f"{label}: replica(s) {sorted(lost)} were lost during the mesh all-reduce "
                f"({why}); the replicas' step failed with them, so the run stops here "
                f"({ctx.resume_advice()})")
        return [reply.payload for reply in replies if reply.payload is not None]  # all, now

    def _read_back(self, ctx: StrategyContext, rnd: int, reader: int, answered: set[int],
                   examples: int, replies: list[Mapping[str, Any]],
                   served: dict[int, int], before: Mapping[str, Any],
                   replicas: Replicas) -> RoundOutcome:
        # Read back over the wire *after* the step: a state remembered from
        # before apply() would hand back the untrained model.
        # Replicas are bit-identical: a reader lost meanwhile, or one whose
        # model does not have the round's keys, shapes and dtypes (its
        # protocol error), is replaced by the next live one.
        expected = signature(before)
        for _ in range(len(ctx.workers)):
            payload = ctx.call([(reader, {"op": "get_state"})])[0].payload
            if payload is not None:
                try:
                    check_contribution(payload["state"], expected, f"rank {reader}'s model")
                    break
                except ProtocolError as exc:
                    ctx.pool.declare_dead(reader, f"protocol error: {exc}")
            reader = self._reader(ctx, replicas, f"round {rnd}: reading the model back")
        else:
            raise MeshError(f"round {rnd}: no replica's model could be read back")
        state = self._outer_step(ctx, before, dict(payload["state"]), replicas)
        metrics = {**train_loss(replies), **ctx.task.evaluate(state)}
        if any("ring_bytes" in r for r in replies):
            # On a mesh: what the replicas' transports sent for the all-reduces (the
            # coordinator's own counters see none of it).
            metrics["ring_bytes"] = float(sum(int(r.get("ring_bytes") or 0) for r in replies))
        # The round's last step says which replica served each shard.
        return RoundOutcome(state, answered=tuple(sorted(answered)), clients=tuple(served),
                            examples=examples, metrics=metrics, served=served)

    def _outer_step(self, ctx: StrategyContext, start: Mapping[str, Any],
                    consensus: dict[str, Any], replicas: Replicas) -> dict[str, Any]:
        """The round's outer step from the model the replicas started at to theirs now."""
        if ctx.outer is None or ctx.outer_name == "average":
            return consensus  # the byte-for-byte path: the replicas carry on as they are
        state = ctx.outer_step(start, consensus)
        replicas.deliver(ctx, ctx.live, {"op": "set_state", "state": state}, everyone=True)
        return state
