"""The strategy contract: what a strategy is given, what it reports, what it returns.

A strategy is an object with ``run(ctx: StrategyContext) -> StrategyResult``.
It never touches sockets: it hands a round's work to the round engine
(:func:`meshkit.train.fold_round`), which sends it to live workers and folds
what comes back with the selected aggregator; it steps the outer optimizer,
and the round skeleton reports each round through
:meth:`StrategyContext.round_completed` (which the runner turns into
metrics, a checkpoint and observer hooks). Who is alive is the pool's
ledger (:attr:`StrategyContext.live`, :attr:`StrategyContext.dead`), never a
list of the strategy's own.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

import attrs
import numpy as np

from meshkit.aggregation import DEFAULT_PIECE_BYTES, Aggregator, begin
from meshkit.errors import MeshError, PeerLostError, PlacementError
from meshkit.outer import OuterOptimizer, step_parameters
from meshkit.partitioner import Partitioner
from meshkit.task import Task, buffer_keys
from meshkit.train._local_keys import ClientLocal
from meshkit.train._failures import reply_failure
from meshkit.train._partitions import Partition, WorkerIdentity
from meshkit.train._pool import Reply, WorkerPool, broadcast, call

log = logging.getLogger(__name__)

__all__ = [
    "Strategy",
    "StrategyContext",
    "StrategyResult",
    "RoundReport",
    "RunStopped",
    "REPORT_FIELDS",
    "weighted_mean",
]


class RunStopped(MeshError):
    """The run was asked to stop (Ctrl-C, a stop handle) between rounds."""


# -- reports -----------------------------------------------------------------


@attrs.frozen
class RoundReport:
    """One finished round: who served which client, who was dropped, and the metrics.

    This is what ``meshkit_round_completed`` observers receive and what each
    line of ``metrics.jsonl`` records. ``answered`` are the ranks that served
    at least one client; ``dropped`` the workers the dead ledger gained since
    the previous report; ``clients`` the clients folded, in fold order;
    ``served`` maps each of them to the rank whose contribution was folded;
    ``not_served`` maps each client the round asked for and could not fold
    to the reason; ``client_examples`` each folded client's examples, and
    ``client_metrics`` each client's own evaluation when clients evaluate;
    ``late`` the ranks whose answer missed the round deadline
    (not dead: they serve the next round); ``joined`` the workers taken in
    at the start of this round (a late joiner, or a restarted worker back
    from the dead ledger).
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
    served: Mapping[int, int] = attrs.Factory(dict)
    not_served: Mapping[int, str] = attrs.Factory(dict)
    #: Examples each folded client trained on (its weight in fedavg).
    client_examples: Mapping[int, int] = attrs.Factory(dict)
    #: Each evaluating client's metrics and held-out ``examples`` (``evaluate = "clients"``).
    client_metrics: Mapping[int, Mapping[str, float]] = attrs.Factory(dict)
    late: tuple[int, ...] = ()
    joined: tuple[int, ...] = ()
    #: Why the round kept the previous global model ("" when it did not): a
    #: non-finite model under ``[strategy] on_nonfinite = "skip-round"``.
    skipped: str = ""
    #: Set when the clients behind the ``client_<metric>`` means are not the
    #: round's clients (a client's node was down): "client means over 2 of 3
    #: clients (not evaluated: 2)"; "" when every client of the round is in them.
    partial_means: str = ""
    #: The clients whose contribution this round was attacked (``[attack]`` or a node
    #: run with ``--attack``): never hidden.
    attacked: tuple[int, ...] = ()
    #: An asynchronous server step (``fedbuff``): how many folded updates had
    #: each staleness τ (server steps between the version a client trained on
    #: and the one it was folded into); {} for a synchronous round.
    staleness: Mapping[int, int] = attrs.Factory(dict)
    #: Each folded client's τ, and the weight its update was folded with
    #: (the staleness rule's, times its fedavg weight's share).
    client_staleness: Mapping[int, int] = attrs.Factory(dict)
    client_weights: Mapping[int, float] = attrs.Factory(dict)
    #: Simulated seconds since the run began when the step happened
    #: (``[simulation] clock = "virtual"``); None on real time.
    simulated_time: float | None = None
    #: Ranks dropped for this round for their own failure (an ``error`` reply, a
    #: contribution that does not fit or is not finite) -> the reason; they are
    #: not dead (``[strategy] accept_failures``, :mod:`meshkit.train._failures`).
    failed: Mapping[int, str] = attrs.Factory(dict)
    #: The workers alive when the round ended (the membership's live ranks). An
    #: asynchronous step's ``answered`` are only the ranks its buffer's updates
    #: came from, so its progress line counts these instead.
    live: tuple[int, ...] = ()

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
            # JSON keys are strings: client ids become "3".
            "served": {str(c): int(r) for c, r in self.served.items()},
            "not_served": {str(c): str(why) for c, why in self.not_served.items()}
            if self.not_served else {},  # (usually empty: no comprehension's call, issue 36)
            "client_examples": {str(c): int(n) for c, n in self.client_examples.items()},
            "client_metrics": {str(c): {k: finite_or_null(v) for k, v in m.items()}
                               for c, m in self.client_metrics.items()}
            if self.client_metrics else {},
            "late": list(self.late),
            "joined": list(self.joined),
            "attacked": list(self.attacked),
            "failed": {str(r): str(why) for r, why in self.failed.items()}
            if self.failed else {},
        }
        if self.skipped:
            line["skipped"] = self.skipped
        if self.partial_means:
            line["partial_means"] = self.partial_means
        if self.staleness:
            line["staleness"] = {str(t): int(n) for t, n in sorted(self.staleness.items())}
            line["client_staleness"] = {str(c): int(t)
                                        for c, t in self.client_staleness.items()}
            line["client_weights"] = {str(c): float(w) for c, w in self.client_weights.items()}
            line["live"] = list(self.live)
        if self.simulated_time is not None:
            line["simulated_time"] = float(self.simulated_time)
        isfinite = math.isfinite
        for name, value in self.metrics.items():
            number = float(value)  # finite_or_null, without a call a metric
            line[f"task.{name}" if name in REPORT_FIELDS else name] = (
                number if isfinite(number) else None)
        return line


def finite_or_null(value: Any) -> float | None:
    """A metric as strict JSON holds it: JSON has no NaN or Infinity, so a non-finite
    one (a diverged round's loss) is written ``null`` (docs/running.md)."""
    number = float(value)
    return number if math.isfinite(number) else None


#: The fields every ``metrics.jsonl`` line has; task metrics come beside them.
REPORT_FIELDS = frozenset(f.name for f in attrs.fields(RoundReport)) - {"metrics"}


@attrs.frozen
class StrategyResult:
    """What a strategy returns: the final state and its last metrics."""

    state: Mapping[str, Any]
    rounds: int
    metrics: Mapping[str, float] = attrs.Factory(dict)
    #: Why the run ended before its last round without an error ("": it did not),
    #: e.g. a privacy budget (``[privacy] target_epsilon``) that the next round would exceed.
    stopped: str = ""


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
    * ``pool`` — reaches the workers; ``workers`` are their ranks; who of
      them is still in is the pool's dead ledger (:attr:`live`, :attr:`dead`).
    * ``start_round``/``global_state`` — where a resumed run picks up.
    * ``on_round(report, state)`` — called after every round (metrics,
      checkpoint, observer hooks); ``stop`` — set it to stop between rounds.
    * ``admit()`` — between rounds, take in the workers that joined late or
      restarted since (capability handshake, job sent); returns their ranks.
      The round skeleton calls it; a strategy never does.
    """

    task: Task
    aggregator: Aggregator
    pool: WorkerPool
    workers: list[int]
    rng: np.random.Generator
    seed: int = 0
    outer: OuterOptimizer | None = None
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
    #: The run's partitioner (``[partitioner]``): how the training set is split into
    #: clients (None: contiguous blocks); ``local`` pins each client to its worker.
    partitioner: Partitioner | None = None
    admit: Callable[[], Sequence[int]] = lambda: ()
    #: The run's privacy mechanism (``[privacy]``, a
    #: :class:`meshkit.privacy.PrivacyMechanism`; None: none).
    privacy: Any = None
    #: Each client's own values of the ``[strategy] local_keys`` (FedBN), checkpointed.
    client_local: ClientLocal = attrs.Factory(ClientLocal)
    #: ``[attack]``: the simulated Byzantine clients (:class:`meshkit.train._attacks.AttackPlan`);
    #: None: every client honest.
    attack: Any = None
    #: ``[simulation]``: each client's fit duration on the virtual clock
    #: (:class:`meshkit.simulation.Speeds`); None: real time.
    speeds: Any = None
    #: What the strategy put in the checkpoint it resumes from (``strategy_state()``
    #: of the run before); {} for a fresh run.
    saved: Mapping[str, Any] = attrs.Factory(dict)
    #: Called after every round, before the checkpoint is written: what the
    #: strategy needs beyond the global model to continue exactly (arrays and
    #: JSON values; ``fedbuff``'s versions in flight and clock). {} by default.
    strategy_state: Callable[[], Mapping[str, Any]] = lambda: {}
    #: A collective run's :class:`meshkit.train.PartialReducer` (every rank plays the round,
    #: one all-reduce: :mod:`meshkit.train._rounds.collective`); None: a coordinator and workers.
    collective: Any = None
    #: ``[secure_aggregation]`` (:class:`meshkit.secure_aggregation.SchemeChoice`); None: rounds
    #: fold plain contributions.
    secure_aggregation: Any = None
    #: ``[compression]`` (:class:`meshkit.compression.CompressionPlan`); None: fits upload
    #: their whole model (:func:`meshkit.train.fold_round` applies it).
    compression: Any = None
    #: ``[compression] residual = "worker"``: which rank keeps each client's residual
    #: (:class:`meshkit.train._rounds.pins.ResidualPins`, made by the first compressed
    #: round); None otherwise.
    residual_pins: Any = None
    #: Bytes of one piece of a contribution the flat round pulls and folds piece by piece
    #: (:mod:`meshkit.train._rounds.pieces`; a model within one piece comes whole).
    piece_bytes: int = DEFAULT_PIECE_BYTES
    #: Bytes of small results the flat round may hold beyond its window, each back with
    #: its fit (:data:`meshkit.train._rounds.work.INLINE_BYTES` when None; 0: every
    #: result beyond the window waits on its worker for a ``take``).
    inline_bytes: int | None = None
    #: ``[strategy] accept_failures``: a member's failure drops that member for the round
    #: (True, the default) or stops the run (:mod:`meshkit.train._failures`).
    accept_failures: bool = True
    #: Rounds each rank was dropped from for its own failure (quarantine counts them).
    strikes: dict[int, int] = attrs.Factory(dict)
    #: Clients (work keys) whose fit stalled two ranks -> why: not served again in this
    #: run, since each try costs a worker (:mod:`meshkit.train._failures`); checkpointed,
    #: so a resumed run does not try them either.
    stalled_clients: dict[int, str] = attrs.Factory(dict)
    #: Ranks whose reply to :meth:`call` or :meth:`broadcast` was an error this round ->
    #: the reason (the round skeleton reports them in ``failed`` and clears them).
    call_failures: dict[int, str] = attrs.Factory(dict)
    #: ``[mesh] authorized_nodes`` (a :class:`meshkit.wire.AuthorizedNodes`): a signed secure
    #: round takes a rank's adverts only when signed by a key it admits for that rank
    #: (:mod:`meshkit.train._rounds.secure`); None: the signatures are checked, not the keys.
    authorized_nodes: Any = None
    #: ``[run] spill``: a :class:`meshkit.spill.Spill` that keeps the global model from
    #: :meth:`initial_state` and :meth:`outer_step`, and the outer optimizer's state, in
    #: mapped files; None: in memory.
    spill: Any = None
    #: What the run has already warned of, by topic: said once a run, not once a process
    #: (a long-lived ``meshkit serve`` plays many runs, each with its own context).
    said: set[str] = attrs.Factory(set)
    _buffers: frozenset[str] | None = attrs.field(default=None, init=False, repr=False)
    _reported: int = attrs.field(default=0, init=False, repr=False)

    @property
    def live(self) -> list[int]:
        """Workers still in the run (joined, not in the dead ledger), in rank order."""
        return self.pool.live(self.workers)

    @property
    def peer_reduce(self) -> bool:
        """Whether the workers can all-reduce among themselves (a mesh, or a transport
        with its own collective such as ``torchdist``): the trainer's ``step``."""
        return bool(getattr(self.pool, "peer_reduce", False))

    @property
    def dead(self) -> dict[int, str]:
        """Workers the ledger declared dead, and why (shown to the user)."""
        ledger = self.pool.dead
        return {r: ledger[r] for r in self.workers if r in ledger}

    def check_stop(self) -> None:
        if self.stop.is_set():
            raise RunStopped("the run was stopped; the last checkpoint is intact")

    def initial_state(self) -> dict[str, Any]:
        """The resumed global state, or the task's initial state from the seed."""
        state = (dict(self.global_state) if self.global_state is not None
                 else self.task.init_state(self.seed))
        return state if self.spill is None else self.spill.global_state(state)

    def call(self, requests: Sequence[tuple[int, Mapping[str, Any]]]) -> list[Reply]:
        """Send requests to workers and wait for every answer (replies in request order).

        A worker that fails to answer is declared dead in the ledger (its
        reply has ``payload=None``). A worker that reports an error (its task
        raised) is a member's failure (:mod:`meshkit.train._failures`): its
        reply has ``payload=None`` and ``error`` the reason, and the round
        reports the rank in ``failed`` (it is not dead); with ``[strategy]
        accept_failures = false`` it stops the run with the worker's message.
        Rounds that fold contributions go through
        :func:`meshkit.train.fold_round` instead, which bounds what is held.
        """
        dead = self.dead
        for rank, _ in requests:
            if rank in dead:
                raise PlacementError(f"rank {rank} was dropped from this run ({dead[rank]}); "
                                     f"cannot send to it")
        return self._failed_replies(call(self.pool, requests, self.timeout))

    def broadcast(self, ranks: Sequence[int], request: Mapping[str, Any]) -> list[Reply]:
        """Send one request to every rank in ``ranks`` (as :meth:`call` would, one each).

        Behind host relays the request crosses the coordinator's link once per
        relay, which fans it out to its ranks. Replies come in ``ranks`` order;
        a lost worker's reply has ``payload=None``, a task error stops the run.
        """
        dead = self.dead
        for rank in ranks:
            if rank in dead:
                raise PlacementError(f"rank {rank} was dropped from this run ({dead[rank]}); "
                                     f"cannot send to it")
        return self._failed_replies(broadcast(self.pool, list(ranks), request, self.timeout))

    def _failed_replies(self, replies: list[Reply]) -> list[Reply]:
        """``replies``, each ``error`` reply a failed one (:meth:`call`)."""
        out = []
        for reply in replies:
            if reply.payload is not None and reply.payload.get("error"):
                reason = reply_failure(reply.rank, reply.payload, accept=self.accept_failures)
                assert reason is not None  # the reply carries an error
                self.call_failures.setdefault(reply.rank, reason)
                log.warning("rank %d failed a request: %s", reply.rank, reason)
                reply = Reply(reply.rank, None, reason, reply.seq)
            out.append(reply)
        return out

    def require_live(self, minimum: int, what: str) -> list[int]:
        """The live workers, or :class:`PeerLostError` naming the dead when fewer than ``minimum``."""
        live = self.live
        if len(live) < minimum:
            lost = ", ".join(f"rank {r} ({why})" for r, why in self.dead.items()) or "none"
            raise PeerLostError(
                f"{what}: {len(live)} worker(s) left, fewer than the {minimum} required "
                f"(dropped: {lost}). {self.resume_advice()}")
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

    @property
    def buffers(self) -> frozenset[str]:
        """The state keys the task marks as buffers (:func:`meshkit.task.buffer_keys`)."""
        if self._buffers is None:
            self._buffers = buffer_keys(self.task)
        return self._buffers

    def outer_step(self, global_state: Mapping[str, Any],
                   consensus: Mapping[str, Any]) -> dict[str, Any]:
        """The new global model: the outer optimizer steps the parameters only.

        The kernel's rule for every optimizer (:func:`meshkit.outer.step_parameters`):
        ``step`` is handed the float arrays that are not the task's buffers;
        buffers, integer arrays and JSON values take the consensus, dtype kept.
        """
        if self.outer is None:
            new = dict(consensus)
        else:
            new = step_parameters(self.outer, global_state, consensus, buffers=self.buffers,
                                  name=self.outer_name)
        if self.spill is None:
            return new
        # The step is done with the consensus: the new model goes to its file, and the
        # optimizer's moments to theirs (meshkit.spill), before anything else reads them.
        self.spill.adopt_outer(self.outer)
        return self.spill.global_state(new)

    def resume_advice(self) -> str:
        """What to do after the run stopped here: ``--resume`` only when a checkpoint exists."""
        done = max(self.start_round, self._reported)
        if done > 0:
            return (f"The last checkpoint (round {done}) is intact; restart the workers and "
                    f"run again with --resume")
        return ("No round completed, so there is no checkpoint to resume from; fix what "
                "stopped the workers and run again (without --resume)")

    def round_completed(self, report: RoundReport, state: Mapping[str, Any]) -> None:
        self.on_round(report, state)
        self._reported = max(self._reported, report.round)

    def aggregation_begin(self, reference: Mapping[str, Any] | None = None) -> Any:
        """A fold of the selected aggregator (streaming when it offers one).

        ``reference`` is the round's global state, given to an aggregator
        that works on updates (``uses_reference``; docs/aggregators.md).
        """
        return begin(self.aggregator, reference=reference)


def weighted_mean(pairs: Iterable[tuple[float, float]]) -> float | None:
    total = weight = 0.0
    for value, w in pairs:
        total += value * w
        weight += w
    return total / weight if weight else None
