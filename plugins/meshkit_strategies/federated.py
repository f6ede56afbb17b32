"""``federated``: rounds of client fits, folded by the aggregator, stepped by the outer optimizer."""

from __future__ import annotations

import inspect
import math
from typing import Any, Mapping

import attrs

from meshkit import ConfigError, RefusedError
from meshkit.compression import is_residual
from meshkit.partitioner import is_per_node
from meshkit.population import is_population, population_size
from meshkit.task import has_held_out
from meshkit.train import RoundOutcome, StrategyContext, StrategyResult, StrategyTraits, Work
from meshkit.train import Broadcast, ClientLocal, Trainable, client_seed, fold_round
from meshkit.train import resolve_local_keys
from meshkit.train import run_rounds
from meshkit.train import cohort_size, poisson_clients, sample_clients, weighted_mean

from meshkit_strategies._shared import require_rows, require_served
from meshkit_strategies.options import FederatedOptions
from meshkit_strategies.private import BudgetReached, check_private, play_private_round
from meshkit_strategies.private import sampling_rate
from meshkit_strategies.secure import play_secure_round


@attrs.frozen
class Federated:
    """Rounds of: sample clients, fit each on its shard, fold, outer step, redistribute.

    The round engine (:func:`meshkit.train.fold_round`) sends the global
    state once to each worker the round needs, hands the sampled clients to
    live workers and folds their fits in client order as it pulls them.
    Which rows a client trains on is the run's partitioner's
    (``[partitioner]``); with ``local`` each worker's own data is one client,
    and only that worker serves it. With ``evaluate = "clients"`` (or
    ``"both"``) the sampled clients evaluate the new global model on their
    own held-out data.
    """

    options: FederatedOptions

    @property
    def traits(self) -> StrategyTraits:
        """What the kernel reads of this strategy: it has clients (the run's partitioner
        splits its training set), plays private rounds under ``[privacy]``
        (meshkit_strategies.private), secure ones under ``[secure_aggregation]``
        (meshkit_strategies.secure) and spmd ones (its rounds go through fold_round)."""
        opts = self.options
        return StrategyTraits(
            partitioned=True, private=True, secure=True, collective=True, compressed=True,
            broadcast=True, rounds=opts.rounds, clients=opts.clients, evaluate=opts.evaluate,
            local_keys=tuple(opts.local_keys), trainable=tuple(opts.trainable),
            round_timeout=opts.round_timeout,
            device=opts.device, count_clients=self.clients, sampling_rate=self.sampling_rate,
            cohort=self.cohort, check=self.check, accept_failures=self.options.accept_failures,
            sampling=opts.sampling, fraction=opts.fraction, min_clients=opts.min_clients)

    def cohort(self, clients: int) -> int:
        """The clients a round folds: ``ceil(fraction * clients)`` (at least ``min_clients``);
        under Poisson sampling the expected count, rounded up."""
        opts = self.options
        if opts.sampling == "poisson":
            return min(clients, max(1, math.ceil(round(opts.fraction * clients, 9))))
        return cohort_size(clients, opts.fraction, opts.min_clients)

    def sampling_rate(self, clients: int) -> float:
        """The probability q a client is in a round, as a privacy accountant composes it."""
        return sampling_rate(self.options)

    def clients(self, workers: int, partitioner: Any = None, task: Any = None) -> int:
        """How many clients the run has: one per worker with ``local``, a population's size
        when the task is one (:mod:`meshkit.population`)."""
        if is_per_node(partitioner):
            return workers
        size = population_size(task)
        if size is not None:
            if self.options.clients not in (0, size):
                raise ConfigError(
                    f"[strategy] clients = {self.options.clients}, but the task is a "
                    f"population of {size} clients; leave clients out (or set it to {size})")
            return size
        return self.options.clients or workers

    def check(self, *, task: Any, outer_name: str, workers: int,
              partitioner: Any = None, privacy: Any = None, compression: Any = None) -> None:
        """Refuse what cannot work before any process starts."""
        opts = self.options
        per_node = is_per_node(partitioner)
        _check_trainable(opts, privacy, compression)
        if privacy is not None and getattr(compression, "broadcast", False):
            raise RefusedError(
                "[compression] broadcast = true with [privacy]: a private round hands its "
                "workers the model through its own clipped fold, and sending it as a delta "
                "is not built into that round yet. Drop broadcast (uploads are still "
                "compressed), or drop [privacy]")
        if privacy is not None:
            check_private(opts, privacy, self.clients(workers, partitioner, task))
        if per_node and opts.clients not in (0, workers):
            raise ConfigError(
                f"[strategy] clients = {opts.clients}, but with [partitioner] name = \"local\" "
                f"each of the {workers} workers' own data is one client; drop clients (or "
                f"set it to {workers})")
        clients = self.clients(workers, partitioner, task)
        if opts.min_clients > clients:
            raise ConfigError(
                f"[strategy] min_clients = {opts.min_clients} but there are only "
                f"{clients} clients; lower min_clients or add clients/workers")
        if opts.evaluate != "coordinator" and not has_held_out(task):
            raise ConfigError(
                f"[strategy] evaluate = {opts.evaluate!r}: the clients evaluate on their own "
                f"held-out data, but the task ({type(task).__name__}) has no test_data() to "
                f"say what that is; give the task test_data(), or use evaluate = "
                f"\"coordinator\"")
        if opts.local_keys and opts.evaluate == "coordinator":
            raise ConfigError(
                f"[strategy] local_keys = {opts.local_keys}: each client keeps those keys for "
                f"itself, so the coordinator holds no model a client uses and its evaluation "
                f"would measure none of them; set evaluate = \"clients\" (each client "
                f"evaluates with its own local keys) or \"both\"")
        if self.options.time_budget and not _takes_time_budget(task):
            raise ConfigError(
                f"[strategy] time_budget = {self.options.time_budget:g}: the task "
                f"({type(task).__name__}) cannot honour a time budget: its fit() takes no "
                f"time_budget argument (docs/tasks.md). Drop time_budget, or give fit() a "
                f"time_budget keyword and stop when it runs out")
        if per_node:
            return  # the coordinator need not hold any data: every node has its own
        require_rows(task, clients)

    def run(self, ctx: StrategyContext) -> StrategyResult:
        self.check(task=ctx.task, outer_name=ctx.outer_name, workers=len(ctx.workers),
                   partitioner=ctx.partitioner)
        if self.options.evaluate != "coordinator":
            self._check_held_out(ctx)
        # The round's state lives in ``last`` and in run_rounds only: a local holding the
        # initial state here kept one model copy alive through every later round.
        last: list[Any] = [ctx.initial_state(), {}, ctx.start_round]
        if self.options.local_keys:
            ctx.client_local.use(resolve_local_keys(self.options.local_keys, last[0], ctx.task))
        trainable = _trainable(self.options.trainable, last[0], ctx.task)
        plan = ctx.compression
        # [compression] broadcast: the model goes down as a delta (meshkit.train.Broadcast).
        broadcast = Broadcast(plan, ctx.seed) if plan is not None and plan.broadcast else None
        if broadcast is not None:
            # The model the workers hold is checkpointed with the run: a resumed run sends
            # the uninterrupted run's bits (meshkit.train._broadcast).
            broadcast.load_state_dict(dict(ctx.saved.get("broadcast") or {}))
            ctx.strategy_state = lambda: {"broadcast": broadcast.state_dict()}

        def play(ctx: StrategyContext, rnd: int, state: Mapping[str, Any]) -> RoundOutcome:
            outcome = self.play_round(ctx, rnd, state, trainable, broadcast)
            last[:] = [outcome.state, outcome.metrics, rnd]
            return outcome
        try:
            # Every round sends its state to each worker it uses (the round engine, the
            # secure round, the clients' evaluation): a joined worker needs none before --
            # except with trainable, whose rounds send a worker they think holds the model
            # (a restarted process may not) only the trainable keys.
            return run_rounds(ctx, "federated", self.options.rounds, last[0], play,
                              on_nonfinite=self.options.on_nonfinite,
                              hand_state=trainable is not None,
                              accept_failures=self.options.accept_failures)
        except BudgetReached as stop:
            # Not an error: the budget was spent; the last round's checkpoint stands.
            return StrategyResult(last[0], last[2], last[1], stopped=stop.reason)

    def _check_held_out(self, ctx: StrategyContext) -> None:
        """Every worker must have held-out data before any round trains (it is asked)."""
        live = ctx.live
        for reply in ctx.call([(r, {"op": "held_out"}) for r in live]):
            if reply.payload is not None and not reply.payload.get("examples"):
                raise ConfigError(
                    f"[strategy] evaluate = {self.options.evaluate!r}, but rank {reply.rank} "
                    f"has no held-out data (its task's test_data() is empty or missing); give "
                    f"that node held-out data (e.g. --task-option test_csv=FILE for digits), or "
                    f"use evaluate = \"coordinator\"")

    def play_round(self, ctx: StrategyContext, rnd: int, state: Mapping[str, Any],
                   trainable: Trainable | None = None,
                   broadcast: Broadcast | None = None) -> RoundOutcome:
        """One round; with ``trainable`` (``[strategy] trainable``) only those keys are
        sent after a worker's first round, answered, folded and stepped. With
        ``broadcast`` (``[compression] broadcast``) each worker is sent a compressed delta
        against the model it holds, and the round is played from the model the workers
        then hold (the decoded broadcast: the fits start from it, the outer step steps
        from it)."""
        opts = self.options
        per_node = is_per_node(ctx.partitioner)
        clients = self.clients(len(ctx.workers), ctx.partitioner, ctx.task)
        if ctx.secure_aggregation is not None:
            return play_secure_round(opts, ctx, rnd, state, clients,
                                     list(ctx.workers) if per_node else None)
        if ctx.privacy is not None:
            return play_private_round(opts, ctx, rnd, state, clients,
                                      list(ctx.workers) if per_node else None)
        sampled = (poisson_clients(ctx.seed, rnd, clients, opts.fraction)
                   if opts.sampling == "poisson"
                   else sample_clients(ctx.rng, clients, opts.fraction, opts.min_clients))
        if not sampled:  # a Poisson draw may sample nobody: the model stays as it is
            return RoundOutcome(state, answered=(), metrics=dict(ctx.task.evaluate(state)))
        # A client's fit is seeded by (run seed, round, client), never by the
        # worker that serves it: any live worker gives the same contribution.
        # With local data, client c *is* worker c: only it has the rows.
        budget = {"time_budget": opts.time_budget} if opts.time_budget else {}
        # Whether the run keeps client-local keys (FedBN), asked once, not once a client.
        local = ctx.client_local if ctx.client_local else None
        work = [Work(c, {"op": "fit", "shard": c, "shards": clients,
                         "seed": client_seed(ctx.seed, rnd, c), **budget,
                         **(_own(local, c) if local is not None else {})},
                     rank=ctx.workers[c] if per_node else None) for c in sampled]
        if trainable is not None:
            trainable.keep_only(ctx.live)
            folded = fold_round(ctx, work, state=trainable.of(state), window=opts.window,
                                deadline=opts.round_timeout or None,
                                send_state=lambda rank: trainable.set_state(rank, state))
            trainable.forget(folded.failed)
            trainable.keep_only(ctx.live)  # lost during the round
        elif broadcast is not None:
            state = broadcast.prepare(state, rnd, _sent_whole(ctx, state, local))
            broadcast.keep_only(ctx.live)
            folded = fold_round(ctx, work, state=state, window=opts.window,
                                deadline=opts.round_timeout or None, local=local,
                                send_state=broadcast.set_state, on_stale=broadcast.stale)
            broadcast.forget(folded.failed)
            broadcast.keep_only(ctx.live)  # lost during the round
        else:
            folded = fold_round(ctx, work, state=state, window=opts.window,
                                deadline=opts.round_timeout or None, local=local)
        require_served(rnd, folded, sampled, opts.min_clients, ctx.resume_advice())
        consensus = folded.result
        assert consensus is not None  # min_clients >= 1 clients were served and folded
        if trainable is not None:
            # The consensus holds only the trainable keys: the frozen rest stays as it is.
            stepped = ctx.outer_step(trainable.of(state), consensus)
            state = {k: stepped.get(k, v) for k, v in state.items()}
        elif local:
            # The consensus lacks the local keys: the global model keeps its own.
            shared = ctx.outer_step({k: v for k, v in state.items() if k not in local.keys},
                                    consensus)
            state = {k: shared.get(k, v) for k, v in state.items()}
        else:
            state = ctx.outer_step(state, consensus)
        metrics = dict(folded.train_loss())
        if opts.evaluate in ("coordinator", "both"):
            metrics.update(ctx.task.evaluate(state))
        per_client: dict[int, dict[str, float]] = {}
        if opts.evaluate in ("clients", "both"):
            per_client = self._evaluate_on_clients(ctx, state, sampled, clients, per_node,
                                                   trainable)
            if broadcast is not None:  # they were sent the new global model, whole
                broadcast.forget(ctx.workers)
            metrics.update(client_means(per_client))
        return folded.outcome(state, metrics, client_metrics=per_client)

    def _evaluate_on_clients(self, ctx: StrategyContext, state: Mapping[str, Any],
                             sampled: list[int], clients: int, per_node: bool,
                             trainable: Trainable | None = None
                             ) -> dict[int, dict[str, float]]:
        """Each sampled client's metrics of ``state`` on its own held-out data."""
        live = ctx.live
        if per_node:
            where = {c: ctx.workers[c] for c in sampled if ctx.workers[c] in live}
        else:
            where = {c: live[i % len(live)] for i, c in enumerate(sampled)} if live else {}
        ranks = sorted(set(where.values()))
        ctx.call([(r, {"op": "set_state", "state": state} if trainable is None
                   else trainable.set_state(r, state)) for r in ranks])
        replies = ctx.call([(r, {"op": "evaluate", "shard": c, "shards": clients,
                                 **_own(ctx.client_local, c, evaluate=True)})
                            for c, r in where.items()])
        found: dict[int, dict[str, float]] = {}
        for client, reply in zip(where, replies):
            if reply.payload is None:  # lost since: the round reports the others
                continue
            found[client] = {**{k: float(v) for k, v in reply.payload["metrics"].items()},
                             "examples": float(reply.payload["examples"])}
        return found


def _sent_whole(ctx: StrategyContext, state: Mapping[str, Any],
                local: ClientLocal | None) -> list[str]:
    """The keys a broadcast delta carries whole, as an upload does: the task's buffers and
    the local keys (meshkit.train._rounds.compressed)."""
    own = {k for k in (local.keys if local else ()) if not is_residual(k)}
    return sorted(own | (ctx.buffers & set(state)))


def _trainable(patterns: list[str], state: Mapping[str, Any], task: Any) -> Trainable | None:
    """``[strategy] trainable``'s keys of the model (None: every key trains). A pattern that
    names no array of the model is a ConfigError; keys that cover the whole model are
    every key (a plain round)."""
    if not patterns:
        return None
    keys = resolve_local_keys(patterns, state, task, where="[strategy] trainable")
    if keys >= set(state):
        return None
    return Trainable(keys)


def _check_trainable(opts: FederatedOptions, privacy: Any, compression: Any) -> None:
    """What ``[strategy] trainable`` does not compose with (yet)."""
    if not opts.trainable:
        return
    for other, present, why in (
            ("[privacy]", privacy is not None, "a private round clips and noises every key "
             "of the update"),
            ("[compression]", compression is not None, "a compressed round encodes the "
             "update of every key"),
            ("[strategy] local_keys", bool(opts.local_keys), "local keys are per client "
             "while frozen keys are per worker")):
        if present:
            raise RefusedError(
                f"[strategy] trainable = {opts.trainable} with {other}: {why}, and sending "
                f"only the trainable keys is not built into it yet. Remove trainable, or "
                f"{other}")


def _own(local: ClientLocal, client: int, *, evaluate: bool = False) -> dict[str, Any]:
    """A request's ``local`` field: the client's own values of the local keys, if it has any
    (an evaluation needs no error-feedback residual: it compresses nothing)."""
    values = local.of(client) if local else {}
    if evaluate:
        values = {k: v for k, v in values.items() if not is_residual(k)}
    return {"local": values} if values else {}


def client_means(per_client: Mapping[int, Mapping[str, float]]) -> dict[str, float]:
    """The example-weighted mean of each client metric, as ``client_<name>``."""
    names = sorted({k for m in per_client.values() for k in m if k != "examples"})
    means: dict[str, float] = {}
    for name in names:
        mean = weighted_mean((m[name], m["examples"]) for m in per_client.values()
                             if name in m)
        if mean is not None:
            means[f"client_{name}"] = mean
    return means


def _takes_time_budget(task: Any) -> bool:
    """Whether ``task.fit`` accepts a ``time_budget`` keyword (how a task says it honours one)."""
    try:
        parameters = inspect.signature(task.fit).parameters
    except (TypeError, ValueError):
        return False
    return "time_budget" in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
