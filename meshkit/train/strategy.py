"""Strategies: how a training run is organised, driven from the coordinator.

A strategy is an object with ``run(ctx: StrategyContext) -> StrategyResult``.
It never touches sockets: it asks the context to send requests to workers
(:meth:`StrategyContext.call`), folds what comes back with the selected
aggregator, steps the outer optimizer, and reports each round through
:meth:`StrategyContext.round_completed` (which the runner turns into
metrics, a checkpoint and observer hooks).

This module also holds the two pieces of semantics every strategy shares:
sharding inputs *with* their targets, and ordering and validating
model-parallel partitions.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Protocol, Sequence

import attrs

from meshkit.errors import ConfigError, MeshError, PeerLostError, PlacementError

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "Strategy",
    "StrategyContext",
    "StrategyResult",
    "RoundReport",
    "WorkerIdentity",
    "WorkerPool",
    "Reply",
    "Partition",
    "RunStopped",
    "shard_bounds",
    "shard_pair",
    "order_partitions",
    "client_seed",
]

log = logging.getLogger(__name__)


class RunStopped(MeshError):
    """The run was asked to stop (Ctrl-C, a stop handle) between rounds."""


# -- sharding ----------------------------------------------------------------


def shard_bounds(rows: int, n: int) -> list[tuple[int, int]]:
    """Row ranges of ``n`` contiguous shards; the last takes the remainder."""
    if n < 1:
        raise ConfigError(f"cannot split data into {n} shards; need at least one worker")
    if rows < n:
        raise ConfigError(
            f"cannot split {rows} rows into {n} shards: every shard needs at least one "
            f"row; use fewer clients or workers")
    size = rows // n
    return [(i * size, rows if i == n - 1 else (i + 1) * size) for i in range(n)]


def shard_pair(x: np.ndarray, y: np.ndarray | None, n: int
               ) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
    """Split inputs and targets into ``n`` shards *together*.

    Sharding ``x`` and handing every worker the whole ``y`` fails silently:
    a 4-row output against an 8-row target broadcasts instead of erroring,
    so each replica would train on pairs that were never pairs. Row counts
    that disagree are therefore an error naming both.
    """
    rows = len(x)
    if y is not None and len(y) != rows:
        raise ConfigError(
            f"sharding across {n} workers: the inputs have {rows} rows and the targets "
            f"have {len(y)}. Each shard pairs example i with target i, so the two must "
            f"agree")
    bounds = shard_bounds(rows, n)
    xs = [x[a:b] for a, b in bounds]
    ys = [None if y is None else y[a:b] for a, b in bounds]
    return xs, ys


def client_seed(seed: int, round_: int, client: int) -> int:
    """The seed of one client's fit in one round, independent of which worker runs it.

    Deriving it from (run seed, round, client) and not from the worker makes
    a run reproducible when workers drop out or a run resumes.
    """
    import numpy as np

    return int(np.random.SeedSequence([seed, round_, client]).generate_state(1)[0])


# -- model-parallel partitions -----------------------------------------------


@attrs.frozen
class Partition:
    """A stage: the graph nodes it owns and the worker it is pinned to.

    ``rank`` pins it to a worker by rank (its id), ``tag`` to the worker
    advertising that tag; exactly one of the two.
    """

    nodes: tuple[str, ...] = attrs.field(converter=tuple)
    rank: int | None = None
    tag: str | None = None

    def target(self) -> str:
        return f"rank {self.rank}" if self.rank is not None else f"tag {self.tag!r}"


def order_partitions(partitions: Sequence[Partition], node_ids: Sequence[str]
                     ) -> list[tuple[Partition, list[str]]]:
    """Put partitions in graph order and check they tile the graph.

    A stage's output is the next stage's input, which only means something
    when every node runs exactly once: a node claimed twice would run twice
    with the second activation overwriting the first, an unclaimed node has
    no worker (model parallelism has no default target), and interleaved
    stages would need the activation to cross back.
    """
    if not partitions:
        raise ConfigError(
            "model-parallel with no partitions: there is nothing to say where any node "
            f"runs. Add [[strategy.partitions]] tables covering {', '.join(node_ids)}")
    position = {node: i for i, node in enumerate(node_ids)}
    claimed: dict[str, int] = {}
    stages: list[tuple[Partition, list[int]]] = []
    for index, partition in enumerate(partitions):
        if not partition.nodes:
            raise ConfigError(f"partition {index} ({partition.target()}) claims no nodes")
        positions = []
        for node in partition.nodes:
            if node not in position:
                raise ConfigError(
                    f"partition {index} claims {node!r}, which is not in this graph. Its "
                    f"nodes are: {', '.join(node_ids)}")
            if node in claimed:
                raise ConfigError(
                    f"{node!r} is claimed by partitions {claimed[node]} and {index}. A node "
                    f"runs in one place")
            claimed[node] = index
            positions.append(position[node])
        stages.append((partition, sorted(positions)))
    unclaimed = [n for n in node_ids if n not in claimed]
    if unclaimed:
        raise ConfigError(
            f"no partition claims {', '.join(unclaimed)}. Every node needs a worker; model "
            f"parallelism has no default target")
    stages.sort(key=lambda item: item[1][0])
    expected = 0
    for partition, positions in stages:
        for pos in positions:
            if pos != expected:
                index = partitions.index(partition)
                raise ConfigError(
                    f"partition {index} is interleaved with another: it owns "
                    f"{node_ids[pos]!r} but not {node_ids[expected]!r}, which runs before "
                    f"it. A stage has to own a contiguous run of the graph")
            expected += 1
    return [(p, [node_ids[i] for i in positions]) for p, positions in stages]


# -- what the context needs from below (workers) -----------------------------


@attrs.frozen
class Reply:
    """A worker's answer to one request (``None`` payload: the worker was lost)."""

    rank: int
    payload: Mapping[str, Any] | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.payload is not None


class WorkerPool(Protocol):
    """Sends requests to workers and collects their replies.

    ``call`` sends every request, then waits (at most ``timeout`` seconds
    overall) for each answer. A worker that disconnects or stalls gets a
    :class:`Reply` with ``payload=None`` and the reason, in request order.
    """

    def call(self, requests: Sequence[tuple[int, Mapping[str, Any]]],
             timeout: float | None) -> list[Reply]: ...

    def close(self) -> None: ...


@attrs.frozen
class WorkerIdentity:
    """How a partition can name a worker: its rank and the tags it advertised."""

    rank: int
    tags: tuple[str, ...] = ()


# -- reports -----------------------------------------------------------------


@attrs.frozen
class RoundReport:
    """One finished round: who answered, who was dropped, and the metrics.

    This is what ``meshkit_round_completed`` observers receive and what each
    line of ``metrics.jsonl`` records.
    """

    round: int
    rounds: int
    strategy: str
    answered: tuple[int, ...]
    dropped: tuple[int, ...] = ()
    clients: tuple[int, ...] = ()
    examples: int = 0
    metrics: Mapping[str, float] = attrs.Factory(dict)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """One line of ``metrics.jsonl``: the report's fields, then the metrics.

        A metric named like a field (``examples``, ``round``, ...) is written
        as ``task.<name>``, so neither overwrites the other.
        """
        line: dict[str, Any] = {
            "round": self.round,
            "rounds": self.rounds,
            "strategy": self.strategy,
            "answered": list(self.answered),
            "dropped": list(self.dropped),
            "clients": list(self.clients),
            "examples": self.examples,
            "seconds": round(self.seconds, 4),
        }
        for name, value in self.metrics.items():
            line[f"task.{name}" if name in REPORT_FIELDS else name] = float(value)
        return line


#: The fields every ``metrics.jsonl`` line has; task metrics come beside them.
REPORT_FIELDS = frozenset(f.name for f in attrs.fields(RoundReport)) - {"metrics"}


@attrs.frozen
class StrategyResult:
    """What a strategy returns: the final state and its last metrics."""

    state: Mapping[str, Any]
    rounds: int
    metrics: Mapping[str, float] = attrs.Factory(dict)


class Strategy(Protocol):
    """How a run is organised; built by a ``meshkit_strategies`` factory."""

    def run(self, ctx: StrategyContext) -> StrategyResult: ...


# -- the context -------------------------------------------------------------


def _never(*_: Any) -> None:
    return None


@attrs.define
class StrategyContext:
    """Everything a strategy needs from the coordinator.

    * ``task`` — the coordinator's own copy of the task (initial state,
      evaluation, the stage graph); workers build theirs from
      ``task_name``/``task_options``.
    * ``aggregator``, ``outer`` — the selected components (``outer`` may be
      None for strategies that have no round consensus).
    * ``rng`` — the run's seeded ``numpy.random.Generator`` (client
      sampling); it is checkpointed, so a resumed run samples the same.
    * ``pool`` — reaches the workers; ``workers`` are their ranks.
    * ``start_round``/``global_state`` — where a resumed run picks up.
    * ``on_round(report, state)`` — called after every round (metrics,
      checkpoint, observer hooks); ``stop`` — set it to stop between rounds.
    """

    task: Any
    aggregator: Any
    pool: WorkerPool
    workers: list[int]
    rng: Any
    seed: int = 0
    outer: Any = None
    outer_name: str = "average"
    strategy_name: str = ""
    identities: list[WorkerIdentity] = attrs.Factory(list)
    timeout: float | None = 60.0
    start_round: int = 0
    global_state: Mapping[str, Any] | None = None
    on_round: Callable[[RoundReport, Mapping[str, Any]], None] = _never
    stop: threading.Event = attrs.Factory(threading.Event)
    #: Fixed-function ranks in the run: rank -> the stage id their board implements.
    boards: dict[int, str] = attrs.Factory(dict)
    #: ``run_board(rank, stage_id, x) -> y``: push a batch of rows through a board rank.
    run_board: Callable[[int, str, Any], Any] | None = None
    dropped: list[int] = attrs.Factory(list)
    #: Reasons each dropped rank was dropped (shown to the user).
    drop_reasons: dict[int, str] = attrs.Factory(dict)

    @property
    def live(self) -> list[int]:
        """Workers still in the run, in rank order."""
        return [r for r in self.workers if r not in self.dropped]

    def check_stop(self) -> None:
        if self.stop.is_set():
            raise RunStopped("the run was stopped; the last checkpoint is intact")

    def initial_state(self) -> dict[str, Any]:
        """The resumed global state, or the task's initial state from the seed."""
        if self.global_state is not None:
            return dict(self.global_state)
        return self.task.init_state(self.seed)

    def call(self, requests: Sequence[tuple[int, Mapping[str, Any]]]) -> list[Reply]:
        """Send requests to workers; a worker that fails to answer is dropped for good.

        A worker that reports an error (its task raised) is not a lost peer:
        that is a bug or a misconfiguration, and it stops the run with the
        worker's message rather than quietly continuing without it.
        """
        for rank, _ in requests:
            if rank in self.dropped:
                raise PlacementError(f"rank {rank} was dropped from this run; cannot send to it")
        replies = self.pool.call(requests, self.timeout)
        for reply in replies:
            if reply.payload is None and reply.rank not in self.dropped:
                self.dropped.append(reply.rank)
                self.drop_reasons[reply.rank] = reply.error or "lost"
                log.warning("rank %d dropped: %s", reply.rank, reply.error or "lost")
            elif reply.payload is not None and reply.payload.get("error"):
                raise MeshError(f"rank {reply.rank}: {reply.payload['error']}")
        return replies

    def require_live(self, minimum: int, what: str) -> list[int]:
        live = self.live
        if len(live) < minimum:
            lost = ", ".join(f"rank {r} ({self.drop_reasons.get(r, 'lost')})"
                             for r in self.dropped) or "none"
            raise PeerLostError(
                f"{what}: {len(live)} worker(s) left, fewer than the {minimum} required "
                f"(dropped: {lost}). The last checkpoint is intact; restart the workers "
                f"and run again with --resume")
        return live

    def worker_for(self, partition: Partition) -> int:
        """The rank a partition is pinned to, by rank or tag; refuses to guess."""
        live = [*self.live, *self.boards]
        if partition.rank is not None:
            if partition.rank in live:
                return partition.rank
            raise PlacementError(
                f"partition {list(partition.nodes)} is pinned to rank {partition.rank}, which "
                f"is not a live worker; live workers: {', '.join(map(str, live)) or 'none'}")
        matches = [i.rank for i in self.identities if partition.tag in i.tags and i.rank in live]
        if not matches:
            known = "; ".join(f"rank {i.rank}: {', '.join(i.tags) or 'no tags'}"
                              for i in self.identities) or "no worker advertised any tag"
            raise PlacementError(
                f"no live worker answers to tag {partition.tag!r} (for partition "
                f"{list(partition.nodes)}). Registered: {known}")
        return matches[0]

    def round_completed(self, report: RoundReport, state: Mapping[str, Any]) -> None:
        self.on_round(report, state)

    def aggregation_begin(self) -> Any:
        """A fold of the selected aggregator (streaming when it offers one)."""
        try:
            from meshkit.aggregation import begin
        except ImportError:  # kernel helper absent: buffer, aggregate once
            return _BufferingFold(self.aggregator)
        return begin(self.aggregator)


@attrs.define
class _BufferingFold:
    aggregator: Any
    states: list[Any] = attrs.Factory(list)
    weights: list[float] = attrs.Factory(list)

    def add(self, state: Any, weight: float = 1.0, *, source: str | None = None) -> None:
        self.states.append(state)
        self.weights.append(weight)

    def result(self) -> dict[str, Any]:
        return dict(self.aggregator.aggregate(self.states, self.weights))


def sample_clients(rng: Any, clients: int, fraction: float, minimum: int) -> list[int]:
    """``ceil(fraction * clients)`` distinct clients (at least ``minimum``), sorted."""
    # Rounded first: 0.07 * 100 is 7.000000000000001 in binary floating
    # point, and its ceiling would sample an eighth client.
    k = min(clients, max(1, minimum, math.ceil(round(fraction * clients, 9))))
    if k >= clients:
        return list(range(clients))
    return sorted(int(c) for c in rng.choice(clients, size=k, replace=False))


def timed() -> Callable[[], float]:
    start = time.perf_counter()
    return lambda: time.perf_counter() - start


def weighted_mean(pairs: Iterable[tuple[float, float]]) -> float | None:
    total = weight = 0.0
    for value, w in pairs:
        total += value * w
        weight += w
    return total / weight if weight else None
