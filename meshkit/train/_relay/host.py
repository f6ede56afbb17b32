"""A host relay's side (``meshkit relay``): its pool over its own ranks, and its answers.

The coordinator's side of a relayed round is :mod:`meshkit.train._rounds.relayed`;
the messages both sides check are :mod:`meshkit.train._messages.relay`.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from typing import Any, Iterable, Mapping, Protocol, Sequence


from meshkit.errors import AggregationError, MeshError, PeerLostError, ProtocolError, WireError
from meshkit.errors import WorkerError
from meshkit.train._messages.check import check_reply
from meshkit.train._messages.fields import MAX_ERROR
from meshkit.train._messages.relay import (FanoutRequest, FoldRequest, parse_relay_request)
from meshkit.train._failures import DivergedFit
from meshkit.train._pool import Reply, WorkerPool, protocol_reason
from meshkit.train._relay.secure import serve_masked_sum
from meshkit.train._relay.grid import serve_grid_sum
from meshkit.train._rounds.relayed import Play, serve_fold
from meshkit.train._protocol import TAG_REQUEST, encode
from meshkit.train._strategy import StrategyContext

__all__ = ["RelayRanks", "RelayPool", "answer_request"]


log = logging.getLogger(__name__)


# -- the relay's side: its pool over its own ranks, and its answers ---------------------------


class RelayRanks(Protocol):
    """What a transport's host relay offers the kernel: its ranks' links.

    ``dead`` (rank -> why) and ``joined`` are the relay's view of its ranks;
    ``lost(rank, reason)`` drops a rank (and tells the coordinator);
    ``send_down(rank, tag, state)`` writes the relay's own frame to a rank
    (raising ``PeerLostError`` when it is not connected).
    """

    @property
    def dead(self) -> Mapping[int, str]: ...

    @property
    def joined(self) -> set[int]: ...

    def lost(self, rank: int, reason: str) -> None: ...

    def send_down(self, rank: int, tag: int, state: Mapping[str, Any]) -> None: ...


#: Where a host relay's own request numbers start: far above any the
#: coordinator uses (it counts from 1), inside the trainer protocol's range
#: of ``seq`` (0..2^63-1).
RELAY_SEQ = 1 << 62


class RelayPool:
    """The round engine's :class:`meshkit.train.WorkerPool` over a host relay's own ranks.

    Requests the relay issues carry ``seq`` numbers from :data:`RELAY_SEQ`
    up, the coordinator's count up from 1 (and never get near it): a
    worker echoes ``seq``, so each reply goes back to whoever asked
    (:meth:`owns`). The transport hands the relay's replies
    in with :meth:`deliver` (from its reader of that rank).
    """

    def __init__(self, ranks: RelayRanks) -> None:
        self._ranks = ranks
        self._cv = threading.Condition()
        self._seq = RELAY_SEQ
        #: rank -> (seq, deadline, request) of each request it owes an answer to.
        self._owed: dict[int, collections.deque[tuple[int, float, Mapping[str, Any]]]] = {}
        self._replies: collections.deque[tuple[int, Mapping[str, Any]]] = collections.deque()
        self._failed: collections.deque[Reply] = collections.deque()

    @property
    def dead(self) -> Mapping[int, str]:
        return self._ranks.dead

    def live(self, ranks: Iterable[int]) -> list[int]:
        joined, dead = self._ranks.joined, self._ranks.dead
        return [r for r in ranks if r in joined and r not in dead]

    def declare_dead(self, rank: int, reason: str) -> None:
        self._ranks.lost(rank, reason)

    @property
    def relays(self) -> dict[str, list[int]]:
        return {}  # a relay's own ranks are direct to it

    def send_relay(self, name: str, request: Mapping[str, Any], timeout: float | None) -> int:
        raise MeshError("a host relay does not relay through another relay")

    def abandon(self, ticket: int) -> None:
        raise MeshError("a host relay's round has no deadline to abandon a request at")

    @property
    def pending(self) -> int:
        with self._cv:
            return len(self._failed) + sum(len(q) for q in self._owed.values())

    def send(self, rank: int, request: Mapping[str, Any], timeout: float | None) -> int:
        with self._cv:
            self._seq += 1
            seq = self._seq
        dead = self._ranks.dead
        if rank in dead:
            with self._cv:
                self._failed.append(Reply(rank, None, dead[rank], seq))
            return seq
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        with self._cv:
            self._owed.setdefault(rank, collections.deque()).append((seq, deadline, request))
        try:
            self._ranks.send_down(rank, TAG_REQUEST, encode({**request, "seq": seq}))
        except (PeerLostError, WireError, OSError) as exc:
            self._ranks.lost(rank, f"send failed: {exc}")
        return seq

    @staticmethod
    def owns(seq: Any) -> bool:
        """Whether ``seq`` (a reply's) answers one of the relay's own requests."""
        return isinstance(seq, int) and not isinstance(seq, bool) and seq > RELAY_SEQ

    def deliver(self, rank: int, reply: Mapping[str, Any]) -> None:
        """A worker answered one of the relay's requests (called by the rank's reader)."""
        with self._cv:
            self._replies.append((rank, reply))
            self._cv.notify_all()

    def wake(self) -> None:
        """Look at the ranks again (one was lost, or the relay is closing)."""
        with self._cv:
            self._cv.notify_all()

    def receive(self, block: bool = True, until: float | None = None) -> Reply | None:
        with self._cv:
            while True:
                if self._failed:
                    return self._failed.popleft()
                while self._replies:
                    rank, reply = self._replies.popleft()
                    owed = self._owed.get(rank)
                    if owed and owed[0][0] == reply.get("seq"):
                        seq, _, request = owed.popleft()
                        try:
                            # The same boundary as the coordinator's (GroupPool):
                            # past here no reply lacks a field or holds a wrong type.
                            check_reply(request, reply, seq)
                        except ProtocolError as exc:
                            reason = protocol_reason(exc)
                            threading.Thread(target=self._ranks.lost, args=(rank, reason),
                                             daemon=True).start()
                            return Reply(rank, None, reason, seq)
                        return Reply(rank, reply, None, seq)
                    log.debug("relay: discarding a stale reply from rank %d", rank)
                if not any(self._owed.values()):
                    raise MeshError("receive() with no request outstanding")
                dead = self._ranks.dead
                now = time.monotonic()
                if until is not None and until <= now:
                    return None
                soonest = math.inf if until is None else until
                for rank, owed in self._owed.items():
                    if not owed:
                        continue
                    if rank in dead:
                        seq, _, _ = owed.popleft()
                        return Reply(rank, None, dead[rank], seq)
                    if owed[0][1] <= now:
                        seq, _, _ = owed.popleft()
                        reason = "no answer within the request's timeout (stalled)"
                        # Not under this lock: losing a rank wakes this pool.
                        threading.Thread(target=self._ranks.lost, args=(rank, reason),
                                         daemon=True).start()
                        return Reply(rank, None, reason, seq)
                    soonest = min(soonest, owed[0][1])
                if not block:
                    return None
                self._cv.wait(min(1.0, max(0.0, soonest - now)))

    def stop_all(self, ranks: Sequence[int]) -> None:
        pass

    def close(self) -> None:
        pass


def _relay_context(pool: WorkerPool, carried: frozenset[int], timeout: float | None,
                   ranks: Sequence[int]) -> StrategyContext:
    # The coordinator names the ranks it counts live (a rank that rejoined is
    # not, until it is taken back between rounds).
    # A partial context: the relay's fold asks for no task, aggregator or rng,
    # so it is not a StrategyContext by its types and is built untyped.
    partial: dict[str, Any] = dict(task=None, aggregator=None, rng=None)
    return StrategyContext(**partial, pool=pool,
                           workers=sorted(r for r in ranks if r in carried), timeout=timeout)


def _fanout(pool: WorkerPool, carried: frozenset[int], request: FanoutRequest) -> dict[str, Any]:
    """Send one request to several of the relay's ranks; each one's answer."""
    ranks = [r for r in request.ranks if r in carried]
    inner = {**request.fields, "op": request.inner}
    tickets = {pool.send(r, inner, request.timeout): r for r in ranks}
    answers: dict[int, Any] = {}
    for _ in tickets:
        reply = pool.receive()
        assert reply is not None
        answers[tickets[reply.seq]] = (
            [False, reply.error] if reply.payload is None
            else [True, reply.payload.get("error")])
    return {"op": "fanout", "answers": [[r, *answers[r]] for r in ranks]}


def _error_text(text: str) -> str:
    """An error as ``RelayFailure.error`` bounds it: 1..MAX_ERROR characters."""
    return (text or "an error without a message")[:MAX_ERROR]


def answer_request(pool: WorkerPool, carried: frozenset[int], name: str,
                   message: Mapping[str, Any], play: Play) -> dict[str, Any]:
    """A host relay's answer to one request of the coordinator (``TAG_RELAY``).

    ``pool`` reaches the relay's own ranks (a :class:`RelayPool` in a real
    relay; any :class:`meshkit.train.WorkerPool`); ``carried`` are the
    ranks it carries, ``name`` its name in errors.

    ``fold`` is served with the round engine on the relay's own ranks
    (:func:`serve_fold`), ``fanout`` sent to each rank named, ``masked_sum``
    (a secure round's) summed mod 2**bits over the ranks named
    (:func:`meshkit.train._relay.secure.serve_masked_sum`), ``grid_sum`` (a
    compressed round's on the shared grid) the ranks' integer sums of codes
    added exactly (:func:`meshkit.train._relay.grid.serve_grid_sum`). A failure is
    the answer's ``error`` (``reason = "aggregation"`` for a refused fold,
    ``rank`` for a task's error), never an exception: the coordinator must
    hear, not wait.
    """
    try:
        if message.get("op") == "masked_sum":  # a secure round's (meshkit.train._relay.secure)
            return serve_masked_sum(pool, carried, message)
        if message.get("op") == "grid_sum":  # a grid round's (meshkit.train._relay.grid)
            return serve_grid_sum(pool, carried, message)
        request = parse_relay_request(message)
        if isinstance(request, FoldRequest):
            return serve_fold(_relay_context(pool, carried, request.timeout, request.ranks),
                              request, play)
        return _fanout(pool, carried, request)
    except DivergedFit as exc:
        return {"error": _error_text(str(exc)), "reason": "nonfinite"}
    except AggregationError as exc:
        return {"error": _error_text(str(exc)), "reason": "aggregation"}
    except WorkerError as exc:
        # The worker's own message: the coordinator names the rank again.
        return {"error": _error_text(exc.detail), "rank": exc.rank}
    except MeshError as exc:
        return {"error": _error_text(str(exc))}
    except Exception as exc:  # noqa: BLE001 (the coordinator must hear, not wait)
        log.exception("relay %r: request %r failed", name, message.get("op"))
        return {"error": _error_text(f"relay {name!r}: {type(exc).__name__}: {exc}")}
