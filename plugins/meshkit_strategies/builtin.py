"""The built-in strategy loops (imported only when a strategy is built)."""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import attrs
import numpy as np

from meshkit.errors import ConfigError, MeshError, RefusedError
from meshkit.train import (
    Partition,
    RoundReport,
    StrategyContext,
    StrategyResult,
    client_seed,
    order_partitions,
    sample_clients,
    timed,
    weighted_mean,
)

from meshkit_strategies.options import (
    DataParallelOptions,
    FederatedOptions,
    LocalOptions,
    ModelParallelOptions,
)

log = logging.getLogger(__name__)


def build(name: str, options: Any) -> Any:
    if name == "local":
        return Local(options or LocalOptions())
    if name == "data-parallel":
        return DataParallel(options or DataParallelOptions())
    if name == "federated":
        return Federated(options or FederatedOptions())
    if name == "model-parallel":
        strategy = ModelParallel(options or ModelParallelOptions())
        strategy.loaded_state()  # a missing checkpoint fails before anything starts
        return strategy
    if name == "population-based":
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
    if name == "custom":
        raise RefusedError(
            "strategy 'custom' is refused: a custom strategy needs a user-provided "
            "coordinator, and this build has none to run. Write a strategy plugin "
            "instead: a meshkit_strategies() hook returning a meshkit.Component whose "
            "factory builds an object with run(ctx: meshkit.StrategyContext) (see "
            "docs/strategies.md), or pick one of local, data-parallel, federated, "
            "model-parallel")
    raise ConfigError(f"no built-in strategy {name!r}")


def _train_loss(replies: Sequence[Any]) -> dict[str, float]:
    loss = weighted_mean((r.payload["metrics"]["train_loss"], r.payload.get("examples", 1))
                         for r in replies if "train_loss" in r.payload.get("metrics", {}))
    return {} if loss is None else {"train_loss": loss}


def _training_rows(task: Any) -> int | None:
    """How many training rows the coordinator's copy of the task has (None: unknown)."""
    data = getattr(task, "train_data", None)
    if not callable(data):
        return None
    x, _ = data()
    return len(x)


# -- local -------------------------------------------------------------------


@attrs.frozen
class Local:
    """One worker, the whole training set, ``rounds`` fits; no aggregation at all."""

    options: LocalOptions

    def run(self, ctx: StrategyContext) -> StrategyResult:
        state = ctx.initial_state()
        rounds = self.options.rounds
        metrics: dict[str, float] = {}
        for rnd in range(ctx.start_round + 1, rounds + 1):
            ctx.check_stop()
            clock = timed()
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
            metrics = {**_train_loss([reply]), **ctx.task.evaluate(state)}
            ctx.round_completed(RoundReport(
                rnd, rounds, "local", answered=(rank,), clients=(0,),
                examples=int(reply.payload["examples"]), metrics=metrics,
                seconds=clock()), state)
        return StrategyResult(state, rounds, metrics)


# -- federated ---------------------------------------------------------------


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
        rows = _training_rows(task)
        if rows is not None and rows < clients:
            raise ConfigError(
                f"[strategy] clients = {clients} but the task has only {rows} training rows; "
                f"every client's shard needs at least one row. Use at most {rows} clients")

    def run(self, ctx: StrategyContext) -> StrategyResult:
        opts = self.options
        clients = opts.clients or len(ctx.workers)
        self.check(task=ctx.task, outer_name=ctx.outer_name, workers=len(ctx.workers))
        state = ctx.initial_state()
        metrics: dict[str, float] = {}
        for rnd in range(ctx.start_round + 1, opts.rounds + 1):
            ctx.check_stop()
            clock = timed()
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
            metrics = {**_train_loss([r for _, r in answered]), **ctx.task.evaluate(state)}
            ctx.round_completed(RoundReport(
                rnd, opts.rounds, "federated",
                answered=tuple(sorted({r.rank for _, r in answered})),
                dropped=tuple(sorted({r.rank for r in replies if not r.ok})),
                clients=tuple(c for c, _ in answered),
                examples=sum(int(r.payload["examples"]) for _, r in answered),
                metrics=metrics, seconds=clock()), state)
        return StrategyResult(state, opts.rounds, metrics)


# -- data-parallel -----------------------------------------------------------


@attrs.frozen
class DataParallel:
    """Synchronous SGD: every step, replicas send gradients of their shard's
    minibatch, the aggregator averages them, and every replica applies the
    same average. The round's state is read back from a replica *after* the
    step, so the training just done is what is returned."""

    options: DataParallelOptions

    def check(self, *, task: Any, outer_name: str, workers: int) -> None:
        """Refuse what cannot work before any process starts."""
        if self.options.min_workers > workers:
            raise ConfigError(
                f"[strategy] min_workers = {self.options.min_workers} but there are only "
                f"{workers} workers; lower min_workers or add workers")
        if outer_name != "average":
            raise ConfigError(
                f"data-parallel applies the averaged gradient on every replica each step; "
                f"there is no round consensus for outer optimizer {outer_name!r} to "
                f"step. Use [outer_optimizer] name = \"average\", or strategy federated")
        for method in ("gradients", "apply"):
            if not callable(getattr(task, method, None)):
                raise ConfigError(f"data-parallel needs the task to offer {method}()")
        rows = _training_rows(task)
        if rows is not None and rows < workers:
            raise ConfigError(
                f"data-parallel shards the task's {rows} training rows over {workers} "
                f"workers; every replica needs at least one row. Use at most {rows} workers")

    def run(self, ctx: StrategyContext) -> StrategyResult:
        opts = self.options
        self.check(task=ctx.task, outer_name=ctx.outer_name if ctx.outer is not None
                   else "average", workers=len(ctx.workers))
        state = ctx.initial_state()
        live = ctx.require_live(opts.min_workers, "start")
        replies = ctx.call([(r, {"op": "set_state", "state": state}) for r in live])
        metrics: dict[str, float] = {}
        for rnd in range(ctx.start_round + 1, opts.rounds + 1):
            ctx.check_stop()
            clock = timed()
            answered: set[int] = set()
            examples = 0
            losses: list[Any] = []
            for step in range(opts.steps):
                live = ctx.require_live(opts.min_workers, f"round {rnd} step {step + 1}")
                global_step = (rnd - 1) * opts.steps + step
                replies = ctx.call([
                    (r, {"op": "grads", "shard": i, "shards": len(live),
                         "batch_size": opts.batch_size,
                         "seed": client_seed(ctx.seed, global_step, i)})
                    for i, r in enumerate(live)])
                ok = [r for r in replies if r.ok]
                if len(ok) < opts.min_workers:
                    ctx.require_live(opts.min_workers, f"round {rnd} step {step + 1}")
                # Each replica's gradient is already the mean over its batch, so
                # every replica counts once (DDP's rule, and allreduce's).
                fold = ctx.aggregation_begin()
                for reply in ok:
                    fold.add(reply.payload["gradients"], 1.0, source=f"rank {reply.rank}")
                averaged = fold.result()
                # The step happens here, on every replica, on the same mean.
                ctx.call([(r.rank, {"op": "apply", "gradients": averaged}) for r in ok])
                answered.update(r.rank for r in ok)
                examples += sum(int(r.payload["examples"]) for r in ok)
                losses.extend(ok)
            reader = ctx.require_live(opts.min_workers, f"round {rnd}")[0]
            # Read back over the wire *after* the step: a state remembered from
            # before apply() would hand back the untrained model.
            back = ctx.call([(reader, {"op": "get_state"})])[0]
            if not back.ok:
                raise MeshError(f"round {rnd}: reading the state back from rank {reader} "
                                f"failed: {back.error}")
            state = dict(back.payload["state"])
            metrics = {**_train_loss(losses), **ctx.task.evaluate(state)}
            ctx.round_completed(RoundReport(
                rnd, opts.rounds, "data-parallel", answered=tuple(sorted(answered)),
                dropped=tuple(sorted(set(ctx.dropped))), examples=examples,
                metrics=metrics, seconds=clock()), state)
        return StrategyResult(state, opts.rounds, metrics)


# -- model-parallel ----------------------------------------------------------


@attrs.define
class ModelParallel:
    """A pipelined forward pass: the task's graph split into stages pinned to
    workers, the held-out set pushed through in batches, each stage's output
    the next stage's input. Reports the accuracy of what comes out."""

    options: ModelParallelOptions
    _state: dict[str, Any] | None = None

    def loaded_state(self) -> dict[str, Any] | None:
        """The model named by ``state_from`` (read once, at build time)."""
        if self.options.state_from and self._state is None:
            from meshkit.checkpoint import load_checkpoint

            try:
                self._state = dict(load_checkpoint(self.options.state_from).state)
            except ConfigError as exc:
                # load_checkpoint speaks of --resume; here the file was named
                # by state_from.
                raise ConfigError(f"[strategy] state_from = {self.options.state_from!r}: "
                                  f"{str(exc).split(';')[0]}") from None
        return self._state

    def extra_ranks(self) -> list[tuple[str, dict[str, Any]]]:
        """Fixed-function ranks a local launch must start: (board name, options)."""
        return [(b.board, dict(b.options)) for b in self.options.boards]

    def partitions(self) -> list[Partition]:
        return [Partition(tuple(p.nodes), rank=p.rank, tag=p.tag)
                for p in self.options.partitions]

    def check(self, *, task: Any, outer_name: str, workers: int) -> None:
        """Refuse what cannot work before any process starts."""
        for method in ("stages", "run_stage", "test_data"):
            if not callable(getattr(task, method, None)):
                raise ConfigError(f"model-parallel needs the task to offer {method}()")
        order_partitions(self.partitions(), list(task.stages()))

    def run(self, ctx: StrategyContext) -> StrategyResult:
        opts = self.options
        self.check(task=ctx.task, outer_name=ctx.outer_name, workers=len(ctx.workers))
        stages = order_partitions(self.partitions(), list(ctx.task.stages()))
        placed = [(ctx.worker_for(p), nodes) for p, nodes in stages]
        loaded = self.loaded_state()
        state = dict(loaded) if loaded is not None else ctx.initial_state()
        keys_of = getattr(ctx.task, "stage_keys", None)
        x, y = ctx.task.test_data()
        metrics: dict[str, float] = {}
        for rnd in range(ctx.start_round + 1, opts.rounds + 1):
            ctx.check_stop()
            clock = timed()
            outputs = [
                thread_activation(ctx, placed, state, x[start:start + opts.batch_size], keys_of)
                for start in range(0, len(x), opts.batch_size)]
            logits = np.concatenate(outputs)
            metrics = _classification_metrics(logits, y)
            ctx.round_completed(RoundReport(
                rnd, opts.rounds, "model-parallel",
                answered=tuple(sorted({r for r, _ in placed})), examples=len(x),
                metrics=metrics, seconds=clock()), state)
        return StrategyResult(state, opts.rounds, metrics)


def thread_activation(ctx: StrategyContext, placed: Sequence[tuple[int, Sequence[str]]],
                      state: Mapping[str, Any], x: Any, keys_of: Any = None) -> Any:
    """Run the stages in order; each receives the previous stage's output."""
    activation = x
    for rank, nodes in placed:
        if rank in ctx.boards:
            activation = _through_board(ctx, rank, nodes, activation)
            continue
        if keys_of is not None:
            needed = {k: state[k] for node in nodes for k in keys_of(node)}
        else:
            needed = dict(state)
        reply = ctx.call([(rank, {"op": "stage", "nodes": list(nodes), "x": activation,
                                  "state": needed})])[0]
        if not reply.ok:
            raise MeshError(f"stage {list(nodes)} on rank {rank} failed: {reply.error}; a "
                            f"pipeline cannot skip a stage")
        activation = reply.payload["x"]
    return activation


def _through_board(ctx: StrategyContext, rank: int, nodes: Sequence[str], x: Any) -> Any:
    """A fixed-function rank runs exactly its one pre-synthesized stage, row by row."""
    stage_id = ctx.boards[rank]
    if list(nodes) != [stage_id]:
        raise ConfigError(
            f"partition {list(nodes)} is pinned to rank {rank}, a fixed-function board that "
            f"implements only stage {stage_id!r}; give that board a partition of exactly "
            f"[{stage_id!r}] and the other nodes to workers")
    if ctx.run_board is None:
        raise ConfigError("this context cannot reach fixed-function ranks")
    return ctx.run_board(rank, stage_id, np.asarray(x))


def _classification_metrics(logits: np.ndarray, y: np.ndarray) -> dict[str, float]:
    logits = np.asarray(logits, dtype=np.float64)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    loss = float(-log_probs[np.arange(len(y)), y].mean())
    return {"loss": loss, "accuracy": float((logits.argmax(axis=1) == y).mean())}
