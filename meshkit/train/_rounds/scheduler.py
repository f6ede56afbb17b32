"""The one scheduler the per-worker round paths play on: what is in flight, who serves next.

Rule: everything a round decides about its *workers* is decided here, once --
which requests are in flight (``busy``: ticket -> rank, kind, unit), which
workers hold the round's state and may be handed work (``ready``), what each
worker is planned to serve and what any worker may take over (``plan``,
``spare``, a busy worker's last unit), the bounded loop that settles one
reply at a time, what a lost worker, an ``error`` reply or a client that
fails on two ranks costs (:mod:`meshkit.train._failures`: ``[strategy]
accept_failures``, quarantine), and what a round abandoned by an exception
leaves owed in the pool. A round path supplies only what differs: its unit
of work (a key for the flat round, :mod:`.engine`; a batch of keys for the
batched round, :mod:`.batched`), the requests it hands out, and what an
answer folds into.

A path subclasses :class:`Scheduler` and implements the hooks in its last
section (:meth:`~Scheduler.hand_out`, :meth:`~Scheduler.answered`,
:meth:`~Scheduler.blamed`, :meth:`~Scheduler.client_dropped`,
:meth:`~Scheduler.requeue`, :meth:`~Scheduler.respare`).
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Callable, Generic, Mapping, Sequence, TypeVar

from meshkit.errors import MeshError, WorkerError
from meshkit.train._failures import DivergedFit, RoundFailures, reply_failure, strike
from meshkit.train._strategy import StrategyContext

__all__ = ["Scheduler", "small_reply"]

log = logging.getLogger(__name__)

#: What one request serves: a key (the flat round) or a batch of keys (the batched round).
Unit = TypeVar("Unit")


def small_reply(examples: Any, result: Mapping[str, Any]) -> dict[str, Any]:
    """What the coordinator keeps of a fit's answer: its examples and metrics, and whether
    its node said it attacked (``meshkit node --attack``)."""
    small: dict[str, Any] = {"examples": examples, "metrics": dict(result.get("metrics") or {})}
    if result.get("attacked"):
        small["attacked"] = str(result["attacked"])
    return small


class Scheduler(Generic[Unit]):
    """One round's workers while it is played (module docstring); a path subclasses it."""

    #: What the round is called when the bounded loop finds a bug in the scheduling.
    name = "the round"
    #: Exceptions that abandon the round: the requests still owed are abandoned in the
    #: pool, so their replies are never taken for the next round's.
    abandon_on: tuple[type[BaseException], ...] = (DivergedFit,)

    def __init__(self, ctx: StrategyContext, state: Mapping[str, Any] | None,
                 label: str) -> None:
        self.ctx, self.state, self.label = ctx, state, label
        #: The ``set_state`` request for each rank (None: the round's state, whole):
        #: ``[strategy] trainable`` sends the whole model only to a worker that lacks it.
        self.state_request: Callable[[int], Mapping[str, Any]] | None = None
        #: Told of a rank that answered its ``set_state`` ``stale`` (``[compression]
        #: broadcast``: it lacks the delta's base), before it is sent the state again,
        #: whole (None: a ``stale`` answer is a protocol breach).
        self.on_stale: Callable[[int], None] | None = None
        #: Ranks sent the state again this round after a ``stale`` answer.
        self.restated: set[int] = set()
        #: The one request each busy worker owes: ticket -> (rank, kind, unit or None).
        self.busy: dict[int, tuple[int, str, Unit | None]] = {}
        #: Workers that hold this round's state and may be handed work.
        self.ready: set[int] = set()
        #: Workers sent the round's state (acknowledged or not), and those lost since.
        self.sent_state: set[int] = set()
        self.lost: set[int] = set()
        #: Units planned for each worker and not handed out yet, in key order.
        self.plan: dict[int, collections.deque[Unit]] = {}
        #: Units whose worker was lost: any worker may serve them, in key order.
        self.spare: collections.deque[Unit] = collections.deque()
        #: The small reply of each key whose fit answered (examples, metrics).
        self.replies: dict[int, Mapping[str, Any]] = {}
        self.served: dict[int, int] = {}
        self.not_served: dict[int, str] = {}
        #: This round's member failures (:mod:`meshkit.train._failures`).
        self.failures = RoundFailures(accept=ctx.accept_failures)
        #: When the round's deadline passes (time.monotonic; None: no deadline).
        self.ends: float | None = None
        self.expired = False

    # -- the round's frame -------------------------------------------------------------

    def play(self) -> Any:
        """The round (:meth:`play_round`); when an exception in :attr:`abandon_on` abandons
        it, every request still owed is abandoned in the pool first."""
        try:
            return self.play_round()
        except self.abandon_on:
            for ticket in self.busy:
                self.ctx.pool.abandon(ticket)
            raise

    def quarantine(self, keys: Sequence[int]) -> list[int]:
        """``keys`` without the clients quarantined for the run (each try would cost a
        worker, :mod:`meshkit.train._failures`), which are recorded as not served."""
        for key in keys:
            if key in self.ctx.stalled_clients:
                self.not_served[key] = f"quarantined: {self.ctx.stalled_clients[key]}"
        return [k for k in keys if k not in self.not_served]

    def plan_round_robin(self, units: Sequence[Unit], workers: Sequence[int]) -> None:
        """Plan ``units`` over ``workers`` in turn (the first worker the first unit, ...);
        with no worker they are spare."""
        for i, unit in enumerate(units):
            if workers:
                self.plan.setdefault(workers[i % len(workers)],
                                     collections.deque()).append(unit)
            else:
                self.spare.append(unit)

    def run(self, keys: int) -> None:
        """Hand out work and settle replies until nothing is owed (bounded: each reply
        settles one request, and a unit is handed out again only after a worker was lost,
        at most once per worker). With a deadline (:attr:`ends`), :meth:`expire` is called
        when it passes without a reply."""
        limit = 8 * (keys + 1) * (len(self.ctx.workers) + 1)
        for _ in range(limit):
            self.dispatch()
            if not self.busy:
                break
            if self.ends is None or self.expired:
                # Not kept in a local: a contribution's arrays go as soon as it is folded.
                self.settle(self.ctx.pool.receive())
                continue
            reply = self.ctx.pool.receive(until=self.ends)
            if reply is None:
                self.expire()
            else:
                self.settle(reply)
        else:  # pragma: no cover - a bug in the scheduling, never a hang
            raise MeshError(f"{self.name} settled {limit} replies without finishing")

    def finish(self) -> None:
        """Count this round's rank failures against the run (quarantine)."""
        strike(self.ctx, self.failures)

    def no_worker_left(self) -> str:
        """Why a key nobody served was not served: no live worker was left."""
        dead = "; ".join(f"rank {r}: {why}" for r, why in self.ctx.dead.items()) or "none"
        why = f"no live worker left to serve it (dead: {dead})"
        if self.failures.ranks:
            why += "; dropped for this round: " + "; ".join(
                f"rank {r}: {w}" for r, w in sorted(self.failures.ranks.items()))
        return why

    # -- sending -----------------------------------------------------------------------

    def send(self, rank: int, kind: str, unit: Unit | None, request: Mapping[str, Any],
             timeout: float | None) -> None:
        self.busy[self.ctx.pool.send(rank, request, timeout)] = (rank, kind, unit)

    def send_state(self, rank: int) -> None:
        """The round's state to ``rank`` (which also discards what it held of this round)."""
        self.sent_state.add(rank)
        request = ({"op": "set_state", "state": self.state} if self.state_request is None
                   else self.state_request(rank))
        self.send(rank, "state", None, request, self.ctx.timeout)

    def dispatch(self) -> None:
        """Give every idle ready worker its next request (:meth:`hand_out`), then
        :meth:`dispatched`."""
        busy = {rank for rank, _, _ in self.busy.values()}
        for rank in sorted(self.ready - busy):
            if self.hand_out(rank, busy):
                busy.add(rank)
        self.dispatched(busy)

    def choices(self, rank: int, busy: set[int]) -> list[tuple[collections.deque[Unit], int]]:
        """Where ``rank``'s next unit may come from, first choice first, as (queue, index):
        its own plan's first, a lost worker's, or the last planned unit of the busy ready
        worker with the most left (a worker that has not acknowledged the state yet keeps
        its plan)."""
        options: list[tuple[collections.deque[Unit], int]] = []
        own = self.plan.get(rank)
        if own:
            options.append((own, 0))
        if self.spare:
            options.append((self.spare, 0))
        victims = [self.plan[r] for r in sorted(self.ready)
                   if r != rank and r in busy and self.plan.get(r)]
        if victims:
            options.append((max(victims, key=len), -1))
        return options

    def next_unit(self, rank: int, busy: set[int]) -> Unit | None:
        """The unit ``rank`` serves next (:meth:`choices`' first), taken off its queue."""
        options = self.choices(rank, busy)
        if not options:
            return None
        units, i = options[0]
        return units.popleft() if i == 0 else units.pop()

    # -- receiving ---------------------------------------------------------------------

    def drain(self) -> None:
        """Settle every reply already there, without waiting, then hand out work."""
        for _ in range(len(self.busy)):
            reply = self.ctx.pool.receive(block=False)
            if reply is None:
                break
            self.settle(reply)
        self.dispatch()

    def settle(self, reply: Any) -> None:
        """One reply (or a failed ticket: its worker is lost) settles its request."""
        assert reply is not None  # a blocking receive gives a reply or a failed ticket
        rank, kind, unit = self.busy.pop(reply.seq)
        if reply.payload is None:  # lost (an error payload is a member's failure, below)
            if not self.failures.accept:
                raise WorkerError(rank, reply.error or "lost")
            self.lose(rank, kind, unit, reply.error or "lost")
            return
        payload = reply.payload
        failure = reply_failure(rank, payload, accept=self.failures.accept)
        if failure is not None:
            self.failed(rank, kind, unit, self.blamed(kind, unit, payload), failure)
            return
        if kind == "state":
            if payload.get("stale") is not None:
                self.restate(rank, str(payload["stale"]))
                return
            self.ready.add(rank)
            return
        self.answered(rank, kind, unit, payload)

    def restate(self, rank: int, why: str) -> None:
        """``rank`` answered its ``set_state`` ``stale``: send it the state again, whole
        (:attr:`on_stale` makes the next request whole). Once a round: a rank that calls
        a whole model stale is in breach of the protocol."""
        if self.on_stale is None or rank in self.restated:
            self.failed(rank, "state", None, None,
                        f"protocol error: it answered set_state stale ({why}), and it was "
                        f"{'sent the whole model' if rank in self.restated else 'sent no delta'}")
            return
        log.info("rank %d cannot apply the broadcast delta (%s); sending the whole model",
                 rank, why)
        self.restated.add(rank)
        self.on_stale(rank)
        self.send_state(rank)

    def failed(self, rank: int, kind: str, unit: Unit | None, key: int | None,
               reason: str) -> None:
        """A member failed: its client's, when ``key`` has now failed on enough ranks
        (:meth:`client_dropped`), else its rank's for the round, whose work is served again."""
        if key is not None and self.failures.client_failed(key, rank, reason):
            self.client_dropped(rank, kind, unit, key)
            return
        self.failures.rank_failed(rank, reason)
        self.lose(rank, kind, unit, reason)

    def lose(self, rank: int, kind: str, unit: Unit | None, reason: str) -> None:
        """A worker is gone for the round: what it held or was doing goes back to the queue
        (:meth:`requeue`, :meth:`respare`)."""
        self.ready.discard(rank)
        self.lost.add(rank)
        again = self.requeue(rank, kind, unit, reason)
        for key in again:
            self.replies.pop(key, None)
        if again:
            self.respare(again)
            log.warning("rank %d lost (%s); %s %s will be served by another worker", rank,
                        reason, self.label + ("s" if len(again) > 1 else ""),
                        ", ".join(map(str, again)))

    # -- what a path supplies ----------------------------------------------------------

    def play_round(self) -> Any:
        """Plan the round, :meth:`run` it, and give back what it folded."""
        raise NotImplementedError

    def hand_out(self, rank: int, busy: set[int]) -> bool:
        """Send idle, ready ``rank`` its next request, if there is one; whether one was sent."""
        raise NotImplementedError

    def dispatched(self, busy: set[int]) -> None:
        """After every idle worker was handed its request (``busy``: the busy ranks)."""

    def answered(self, rank: int, kind: str, unit: Unit | None,
                 payload: Mapping[str, Any]) -> None:
        """A request other than ``set_state`` answered without an error."""
        raise NotImplementedError

    def blamed(self, kind: str, unit: Unit | None, payload: Mapping[str, Any]) -> int | None:
        """The client an ``error`` reply to this request names, if any."""
        raise NotImplementedError

    def client_dropped(self, rank: int, kind: str, unit: Unit | None, key: int) -> None:
        """``key``'s failure is its own (:meth:`failed`): it is not served again this round."""
        raise NotImplementedError

    def requeue(self, rank: int, kind: str, unit: Unit | None, reason: str) -> list[int]:
        """``rank`` was lost while it owed ``unit``: forget what it held or was planned and
        give back the keys to serve again, ascending."""
        raise NotImplementedError

    def respare(self, again: list[int]) -> None:
        """Put ``again`` (ascending keys whose worker was lost) back as spare units."""
        raise NotImplementedError

    def expire(self) -> None:
        """The round's deadline (:attr:`ends`) passed with requests still owed."""
        raise NotImplementedError
