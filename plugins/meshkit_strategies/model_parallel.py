"""``model-parallel``: the task's graph split into stages pinned to workers (or boards).

The held-out set is pushed through in batches; each stage's output is the
next stage's input, and the round reports the accuracy of what comes out.
A fixed-function rank runs exactly its one pre-synthesized stage.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import attrs
import numpy as np

from meshkit import ConfigError, MeshError
from meshkit.checkpoint import load_checkpoint
from meshkit.train import (
    Partition,
    RoundOutcome,
    StrategyContext,
    StrategyResult,
    StrategyTraits,
    order_partitions,
    run_rounds,
)

from meshkit_strategies.options import ModelParallelOptions


@attrs.define
class ModelParallel:
    """A pipelined forward pass: the task's graph split into stages pinned to
    workers, the held-out set pushed through in batches, each stage's output
    the next stage's input. Reports the accuracy of what comes out."""

    options: ModelParallelOptions
    _state: dict[str, Any] | None = None

    @property
    def traits(self) -> StrategyTraits:
        """A pipelined evaluation: its boards are extra ranks, ``state_from`` the model an
        evaluation-only run evaluates."""
        return StrategyTraits(rounds=self.options.rounds, check=self.check,
                              extra_ranks=self.extra_ranks(), loaded_state=self.loaded_state)

    def loaded_state(self) -> dict[str, Any] | None:
        """The model named by ``state_from`` (read once, at build time)."""
        if self.options.state_from and self._state is None:
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
        # Ranks are the workers, then the boards; a pin past them would only
        # fail once every process had started.
        ranks = workers + len(self.options.boards)
        for p in self.options.partitions:
            if p.rank is not None and not 1 <= p.rank <= ranks:
                raise ConfigError(
                    f"[strategy] partition {list(p.nodes)} is pinned to rank {p.rank}, but the "
                    f"run has ranks 1..{ranks} ({workers} worker(s), "
                    f"{len(self.options.boards)} board(s)); pin it to one of those, or add "
                    f"workers")

    def run(self, ctx: StrategyContext) -> StrategyResult:
        opts = self.options
        self.check(task=ctx.task, outer_name=ctx.outer_name, workers=len(ctx.workers))
        task: Any = ctx.task  # check() made sure it offers the optional staged methods
        stages = order_partitions(self.partitions(), list(task.stages()))
        placed = [(ctx.worker_for(p), nodes) for p, nodes in stages]
        loaded = self.loaded_state()
        state = dict(loaded) if loaded is not None else ctx.initial_state()
        keys_of = getattr(task, "stage_keys", None)
        x, y = task.test_data()

        def play_round(ctx: StrategyContext, rnd: int,
                       state: Mapping[str, Any]) -> RoundOutcome:
            outputs = [
                thread_activation(ctx, placed, state, x[start:start + opts.batch_size], keys_of)
                for start in range(0, len(x), opts.batch_size)]
            logits = np.concatenate(outputs)
            return RoundOutcome(state, answered=tuple(sorted({r for r, _ in placed})),
                                examples=len(x), metrics=_classification_metrics(logits, y))

        return run_rounds(ctx, "model-parallel", opts.rounds, state, play_round)


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
        if reply.payload is None:
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
