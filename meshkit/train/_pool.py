"""Reaching the workers from the coordinator; who is alive comes from one ledger.

A pool sends trainer requests (:meth:`WorkerPool.send`) and hands back the
replies as they arrive, from whichever worker answers first
(:meth:`WorkerPool.receive`). A worker serves its requests one after another,
so each request's deadline starts when the one before it on that worker was
answered.

Liveness is decided in one place, the transport's membership
(``meshkit/transport/_membership.py``, read through ``group.dead``): a
:class:`GroupPool`'s live workers are the group's joined ranks minus
``group.dead``, and a worker that disconnects, fails a send or stalls past a
request's deadline is declared dead *there* (``group.declare_dead``), so the
strategy, the engine, the runner's report and the transport (which drops the
link, so a late frame cannot pass for a live one) all agree. A send never
raises for a lost worker: the loss comes back from ``receive`` as a
:class:`Reply` with ``payload=None`` and the reason, once per request that
worker still owed.

:class:`LocalPool` runs the same protocol in-process, with a membership of its
own (tests, the strategy contract suite): ``fail`` simulates a lost worker,
``order`` (a seeded ``numpy.random.Generator``) answers pending requests in
a shuffled order, and ``peak_held`` counts the most whole states it handed
to the coordinator that were alive at once.

Host relays (``meshkit relay``): a group lists them in ``group.relays``
(name -> the live ranks each carries; the transport's ``Links.relays``),
and a :class:`GroupPool` then also sends requests to a relay itself
(:meth:`GroupPool.send_relay`): its ticket is lost when the relay is, not
when one of its ranks is. :func:`broadcast` sends one request to many
ranks, once per relay for the ranks behind one.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import operator
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

import attrs
import numpy as np

from meshkit.errors import MeshError, PeerLostError, ProtocolError
from meshkit.state import is_array
from meshkit.train._messages import check_reply
from meshkit.train._protocol import TAG_REPLY, TAG_REQUEST, decode, encode
from meshkit.transport import Membership
from meshkit.transport.tags import TAG_RELAY, TAG_UP
from meshkit.train._worker.trainer import Trainer

__all__ = ["Reply", "WorkerPool", "LocalPool", "GroupPool", "call", "broadcast", "wire_bytes"]

log = logging.getLogger(__name__)


def wire_bytes(pool: Any) -> tuple[int, int] | None:
    """(bytes up, bytes down) the coordinator's transport has counted so far: what its
    workers sent it and what it sent them, measured on the wire (None: not counted)."""
    return pool.wire_bytes() if isinstance(pool, GroupPool) else None

#: How often (seconds) a wait for replies looks at the dead ledger: a death
#: the transport records mid-wait is acted on within this long.
POLL_SECONDS = 0.1

#: A request carrying at least this many bytes of arrays is written on a thread of its
#: own (module docstring): below it a write is short, and a thread would cost more.
CONCURRENT_BYTES = 4 << 20


#: ``isinstance(value, np.ndarray)`` and ``value.nbytes`` as C callables (see _array_bytes).
_IS_ARRAY = functools.partial(type.__instancecheck__, np.ndarray)
_NBYTES = operator.attrgetter("nbytes")


def _array_bytes(message: Mapping[str, Any]) -> int:
    """Bytes of the arrays in an encoded message's top level (a state is flattened there).

    Every request sent asks this. Summed in C: a loop or a generator was two or three
    lines of Python an entry (issue 36)."""
    return sum(map(_NBYTES, filter(_IS_ARRAY, message.values())))


@attrs.frozen
class Reply:
    """A worker's answer to one request (``None`` payload: the worker was lost, ``error`` says why)."""

    rank: int
    payload: Mapping[str, Any] | None
    error: str | None = None
    #: The request's ticket, as :meth:`WorkerPool.send` returned it.
    seq: int = 0

    @property
    def ok(self) -> bool:
        """Answered, and not with an ``error`` payload (a member's failure:
        :func:`meshkit.train.reply_failure`); a lost worker's reply has no payload."""
        return self.payload is not None and not self.payload.get("error")


class WorkerPool(Protocol):
    """Sends trainer requests to workers and hands back replies as they come.

    ``dead`` is the ledger (rank -> why it was declared dead; deaths are
    permanent); ``live(ranks)`` the given ranks that are still in.
    ``send`` returns a ticket and never raises for a lost worker;
    ``receive`` blocks for the next reply to any outstanding request, a
    lost worker's requests coming back as failed :class:`Reply` records
    (``receive(block=False)`` returns None at once when none is there yet).
    ``pending`` counts requests not answered yet. ``receive(until=T)``
    returns None once ``time.monotonic()`` reaches ``T`` with no reply (a
    round deadline); ``abandon(ticket)`` gives up on a request without
    declaring its worker dead: the late reply, when it comes, is discarded
    (never handed to a later request), and the worker serves its next
    request after it.

    ``relays`` lists the host relays the pool reaches (relay name -> the
    live ranks each carries; ``{}`` without any), and ``send_relay`` sends
    a request to a relay itself: its ticket fails when the relay is lost
    (not when one of its ranks is). A pool without relays never has
    ``send_relay`` called.
    """

    @property
    def dead(self) -> Mapping[int, str]: ...

    @property
    def relays(self) -> Mapping[str, Sequence[int]]: ...

    def send_relay(self, name: str, request: Mapping[str, Any], timeout: float | None) -> int: ...

    def live(self, ranks: Iterable[int]) -> list[int]: ...

    def declare_dead(self, rank: int, reason: str) -> None: ...

    def send(self, rank: int, request: Mapping[str, Any], timeout: float | None) -> int: ...

    def receive(self, block: bool = True, until: float | None = None) -> Reply | None: ...

    def abandon(self, ticket: int) -> None: ...

    @property
    def pending(self) -> int: ...

    def stop_all(self, ranks: Sequence[int]) -> None: ...

    def close(self) -> None: ...


def call(pool: WorkerPool, requests: Sequence[tuple[int, Mapping[str, Any]]],
         timeout: float | None) -> list[Reply]:
    """Send every request, wait for every answer; the replies in request order."""
    if pool.pending:
        raise MeshError(f"call() while {pool.pending} request(s) are outstanding; finish "
                        f"receiving those first")
    tickets = [pool.send(rank, request, timeout) for rank, request in requests]
    replies: dict[int, Reply] = {}
    for _ in tickets:
        reply = pool.receive()
        assert reply is not None  # a blocking receive always returns one
        replies[reply.seq] = reply
    return [replies[t] for t in tickets]


def broadcast(pool: WorkerPool, ranks: Sequence[int], request: Mapping[str, Any],
              timeout: float | None) -> list[Reply]:
    """Send the same ``request`` to every rank in ``ranks``; the replies in rank order.

    Ranks behind a host relay get it through one ``fanout`` request to that
    relay (the request crosses the coordinator's link once per relay, not
    once per rank); the others one request each, as :func:`call` sends.
    """
    owner = {r: name for name, carried in pool.relays.items() for r in carried}
    groups: dict[str, list[int]] = {}
    for rank in ranks:
        if rank in owner:
            groups.setdefault(owner[rank], []).append(rank)
    single = [(r, request) for r in ranks if r not in owner or len(groups[owner[r]]) == 1]
    fanned = {name: rs for name, rs in groups.items() if len(rs) > 1}
    if not fanned:
        return call(pool, single, timeout)
    if pool.pending:
        raise MeshError(f"broadcast() while {pool.pending} request(s) are outstanding; "
                        f"finish receiving those first")
    to_rank = {pool.send(rank, req, timeout): rank for rank, req in single}
    to_relay: dict[int, str] = {}
    for name, carried in fanned.items():
        fan = {**request, "op": "fanout", "inner": request["op"], "ranks": carried,
               "timeout": timeout}
        to_relay[pool.send_relay(name, fan, timeout)] = name
    replies: dict[int, Reply] = {}
    for _ in range(len(to_rank) + len(to_relay)):
        reply = pool.receive()
        assert reply is not None
        if reply.seq in to_rank:
            replies[to_rank[reply.seq]] = reply
            continue
        who = to_relay[reply.seq]
        carried = fanned[who]
        if reply.payload is None or reply.payload.get("error"):
            why = reply.error if reply.payload is None else str(reply.payload["error"])
            for rank in carried:
                # The relay itself failed: every rank it was to reach failed with it.
                replies[rank] = (Reply(rank, None, why, reply.seq) if reply.payload is None
                                 else Reply(rank, {"error": why}, None, reply.seq))
            continue
        answers = reply.payload.get("answers")
        problem = _fanout_problem(answers, carried)
        if problem is not None:
            # That relay alone broke the protocol: its ranks go, the others' answers stand.
            why = protocol_reason(ProtocolError(f"host relay {who!r}: {problem}"))
            for rank in carried:
                pool.declare_dead(rank, why)
                replies[rank] = Reply(rank, None, why, reply.seq)
            continue
        assert answers is not None  # _fanout_problem refused anything else
        for rank, ok, error in answers:
            if not ok:
                # The relay lost the rank: declared dead here too, as a rank lost on
                # a direct link is (GroupPool), so the ledger says what the reply does.
                pool.declare_dead(rank, f"lost behind host relay {who!r}: {error}")
            replies[rank] = (Reply(rank, {} if error is None else {"error": error}, None,
                                   reply.seq) if ok
                             else Reply(rank, None, str(error), reply.seq))
        for rank in carried:
            replies.setdefault(rank, Reply(rank, None, f"host relay {who!r} did not answer "
                                                        f"for rank {rank}", reply.seq))
    return [replies[r] for r in ranks]


def _fanout_problem(answers: Any, carried: Sequence[int]) -> str | None:
    """Why a relay's ``fanout`` answers do not fit, or None: ``[[rank, ok, error or null]]``,
    each rank one it was asked to reach, at most once."""
    if not isinstance(answers, list):
        return f"its 'fanout' answer has no list of answers ({type(answers).__name__})"
    seen: set[int] = set()
    for entry in answers:
        if not (isinstance(entry, list) and len(entry) == 3):
            return f"a 'fanout' answer {entry!r:.80} is not [rank, ok, error]"
        rank, ok, error = entry
        if isinstance(rank, bool) or not isinstance(rank, int) or rank not in carried:
            return f"a 'fanout' answer for rank {rank!r:.40}, not one of {list(carried)}"
        if rank in seen or not isinstance(ok, bool) or not (error is None
                                                            or isinstance(error, str)):
            return f"a malformed or repeated 'fanout' answer for rank {rank}"
        seen.add(rank)
    return None


@attrs.define
class _Outstanding:
    """The requests one worker owes, oldest first, and when it began on the oldest.

    Each ticket keeps what its reply is checked against
    (:func:`meshkit.train._messages.check_reply`): the request's ``op`` and
    ``keep``, never its state.
    """

    tickets: collections.deque[tuple[int, float | None, dict[str, Any]]] = attrs.Factory(
        collections.deque)
    since: float = 0.0
    #: The ticket whose request a writer thread is still writing (0: none): its deadline
    #: starts when the write is done (:meth:`written`).
    writing: int = 0

    def written(self, seq: int) -> None:
        """The request of ticket ``seq`` is all on the wire: its worker starts on it now
        (when it is the oldest owed; else when the one before it is answered)."""
        if self.writing == seq:
            if self.tickets and self.tickets[0][0] == seq:
                self.since = time.monotonic()
            self.writing = 0

    def push(self, seq: int, timeout: float | None, request: Mapping[str, Any]) -> None:
        if not self.tickets:
            self.since = time.monotonic()
        self.tickets.append((seq, timeout, _answers_to(request)))

    def pop(self) -> int:
        seq, _, _ = self.tickets.popleft()
        # The worker starts on its next request once it answered this one.
        self.since = time.monotonic()
        return seq

    def deadline(self) -> float:
        seq, timeout, _ = self.tickets[0]
        if timeout is None or seq == self.writing:
            return math.inf  # (a write in progress is bounded by the link's stall timeout)
        return self.since + timeout


def _answers_to(request: Mapping[str, Any]) -> dict[str, Any]:
    """What a reply to ``request`` is checked against: its op, keep when it has one, and a
    ``fit_batch``'s keys."""
    answers = {"op": request.get("op"), **({"keep": request["keep"]} if "keep" in request
                                            else {})}
    if request.get("op") == "fit_batch":
        answers["keys"] = [fit["key"] for fit in request["fits"]]
        answers["compressed"] = request.get("compress") is not None
        answers["grid"] = "clip_range" in (request.get("compress") or {})
    return answers


def protocol_reason(error: ProtocolError) -> str:
    """The dead ledger's reason for a rank whose message did not fit its schema."""
    return f"protocol error: {error}"


@attrs.define
class GroupPool:
    """Reaches workers through a transport group (the coordinator is rank 0)."""

    group: Any
    #: The workers that were handed this run's job (the runner admits a rank
    #: that joins late or rejoins only between rounds); None: every joined rank.
    admitted: set[int] | None = None
    _seq: int = 0

    @property
    def peer_reduce(self) -> bool:
        """Whether the workers reach each other directly (a mesh), so they can all-reduce
        among themselves (``group.mesh_all_reduce``) instead of through rank 0."""
        return not getattr(self.group, "is_star", True)
    _owed: dict[int, _Outstanding] = attrs.Factory(dict)
    _failed: collections.deque[Reply] = attrs.Factory(collections.deque)
    #: Tickets given up on (a round deadline passed): their replies are discarded.
    _abandoned: set[int] = attrs.Factory(set)
    #: Requests to host relays: seq -> (relay name, the rank addressed, deadline).
    _relay_owed: dict[int, tuple[str, int, float]] = attrs.Factory(dict)
    #: The writer thread of each rank's latest request written on a thread (module
    #: docstring), and what a writer raised that is no lost link (raised by the pool's
    #: next send or receive, as a write on the caller's thread would have raised it).
    _writers: dict[int, threading.Thread] = attrs.Factory(dict)
    _write_errors: list[BaseException] = attrs.Factory(list)
    #: Each request still on a writer thread: seq -> the thread. Its reply means the write
    #: is done; the pool waits for the thread to finish (the transport counts a write's
    #: bytes as it returns) before handing the reply on, so ``wire_bytes`` read after a
    #: reply counts that request whole, in its own round.
    _writing: dict[int, threading.Thread] = attrs.Factory(dict)

    def wire_bytes(self) -> tuple[int, int] | None:
        """(body bytes received, body bytes sent) so far, as the transport counted them on
        the wire; None when it counts none (a transport need not)."""
        try:
            return int(self.group.bytes_in), int(self.group.bytes_out)
        except AttributeError:
            return None

    @property
    def relays(self) -> dict[str, list[int]]:
        """The group's host relays (name -> the live ranks each carries); {} without any."""
        return {name: list(ranks) for name, ranks in self.group.relays.items()}

    def send_relay(self, name: str, request: Mapping[str, Any], timeout: float | None) -> int:
        """Send ``request`` to host relay ``name`` itself; a ticket, as :meth:`send` gives.

        The relay answers on the trainer's reply tag, naming itself; the
        ticket fails when the relay is lost (not when one of its ranks is),
        or after ``timeout`` seconds.
        """
        self.flush()  # a relay's link carries its ranks' requests too: keep their order
        self._seq += 1
        seq = self._seq
        live = self.relays.get(name)
        if not live:
            self._failed.append(Reply(-1, None, f"host relay {name!r} is lost or carries no "
                                                f"live rank", seq))
            return seq
        try:
            self.group.send(live[0], TAG_RELAY, encode({**request, "seq": seq}))
        except (PeerLostError, OSError) as exc:
            self._failed.append(Reply(live[0], None, f"host relay {name!r}: {exc}", seq))
            return seq
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        self._relay_owed[seq] = (name, live[0], deadline)
        return seq

    #: What each dead worker said before it left (its job's error report), by rank.
    _last_words: dict[int, str] = attrs.Factory(dict)

    @property
    def dead(self) -> dict[int, str]:
        """The ledger's dead workers and why, with what each reported before it left.

        A node whose job fails (a bad ``--task-option``, a task it cannot
        build) tells rank 0 why (``report_job_error``, on ``TAG_UP``) and then
        closes its link; the ledger only sees the closed link, so its reason
        would be "closed its connection" without the one that matters.
        """
        dead = dict(self.group.dead)
        for rank in dead:
            said = self._last_word(rank)
            if said:
                dead[rank] = f"{dead[rank]}; it reported: {said}"
        return dead

    def _last_word(self, rank: int) -> str:
        if rank not in self._last_words:
            said = ""
            for _ in range(8):  # bounded: a few queued node-driver messages at most
                try:
                    message = self.group.recv(rank, TAG_UP, timeout=0.001)
                except PeerLostError:
                    break  # nothing queued, and nothing more can come
                if isinstance(message, Mapping) and message.get("kind") == "error":
                    said = str(message.get("message", ""))
                    break
            self._last_words[rank] = said
        return self._last_words[rank]

    #: The group's (generation, dead ledger, joined ranks) when last copied (:meth:`_members`).
    _copied: tuple[int, dict[int, str], frozenset[int]] | None = None

    def _members(self) -> tuple[dict[int, str], frozenset[int]]:
        """The group's dead ledger and joined ranks, copied again only when its
        ``generation`` moved (each send, receive and ``live`` asks; issue 36); a group
        without one is copied every time. Read-only: callers must not change them."""
        generation = getattr(self.group, "generation", None)
        copied = self._copied
        if copied is not None and generation is not None and copied[0] == generation:
            return copied[1], copied[2]
        # The generation was read first: a change while copying shows in the copy, and
        # the next call (seeing a newer generation) copies again.
        dead, joined = self.group.dead, frozenset(self.group.joined)
        if generation is not None:
            self._copied = (generation, dead, joined)
        return dead, joined

    def live(self, ranks: Iterable[int]) -> list[int]:
        dead, joined = self._members()
        admitted = self.admitted  # changed in place between rounds: asked each call
        return [r for r in ranks if r in joined and r not in dead
                and (admitted is None or r in admitted)]

    def abandon(self, ticket: int) -> None:
        self._abandoned.add(ticket)

    def declare_dead(self, rank: int, reason: str) -> None:
        # The ledger drops the link too, so a late frame from the rank can
        # never be mistaken for a live one.
        self.group.declare_dead(rank, reason)

    @property
    def pending(self) -> int:
        return (len(self._failed) + len(self._relay_owed) + sum(
            1 for o in self._owed.values() for seq, _, _ in o.tickets
            if seq not in self._abandoned))

    def _relay_failure(self, now: float) -> Reply | None:
        """A request to a host relay that can no longer be answered, or None."""
        if not self._relay_owed:
            return None
        relays = self.relays
        for seq, (name, rank, deadline) in list(self._relay_owed.items()):
            if name not in relays:
                del self._relay_owed[seq]
                return Reply(rank, None, f"host relay {name!r} was lost", seq)
            if deadline <= now:
                del self._relay_owed[seq]
                return Reply(rank, None, f"host relay {name!r} did not answer in time "
                                         f"(stalled)", seq)
        return None

    def send(self, rank: int, request: Mapping[str, Any], timeout: float | None) -> int:
        self._seq += 1
        seq = self._seq
        dead, _ = self._members()
        if rank in dead:
            self._failed.append(Reply(rank, None, dead[rank], seq))
            return seq
        if self._write_errors:  # (a list's truth, not a call, on every request)
            self._raise_write_error()
        message = encode({**request, "seq": seq})
        before = self._writers.get(rank)
        if before is not None and not before.is_alive():
            before = None
            del self._writers[rank]
        if before is None and _array_bytes(message) < CONCURRENT_BYTES:
            try:
                self.group.send(rank, TAG_REQUEST, message)
            except (PeerLostError, OSError) as exc:
                self.declare_dead(rank, f"send failed: {exc}")
                self._failed.append(Reply(rank, None, self.group.dead.get(rank, str(exc)),
                                          seq))
                return seq
            self._owed.setdefault(rank, _Outstanding()).push(seq, timeout, request)
            return seq
        owes = self._owed.setdefault(rank, _Outstanding())
        owes.push(seq, timeout, request)
        owes.writing = seq
        writer = threading.Thread(target=self._write, args=(rank, seq, message, before, owes),
                                  name=f"meshkit-pool-write-{rank}", daemon=True)
        self._writers[rank] = writer
        for done in [s for s, thread in self._writing.items() if not thread.is_alive()]:
            del self._writing[done]  # answered never (its ticket abandoned or failed)
        self._writing[seq] = writer
        writer.start()
        return seq

    def _write(self, rank: int, seq: int, message: Mapping[str, Any],
               before: threading.Thread | None, owes: _Outstanding) -> None:
        """A writer thread: ``message`` to ``rank`` once the request before it is written."""
        if before is not None:
            before.join()
        try:
            if rank not in self.group.dead:  # (else its ticket fails from the ledger)
                self.group.send(rank, TAG_REQUEST, message)
        except (PeerLostError, OSError) as exc:
            self.declare_dead(rank, f"send failed: {exc}")
        except BaseException as exc:  # e.g. a payload the wire cannot carry: the caller's
            self._write_errors.append(exc)
            self.declare_dead(rank, f"send failed: {exc}")
        finally:
            owes.written(seq)

    def _raise_write_error(self) -> None:
        if self._write_errors:
            raise self._write_errors.pop(0)

    def flush(self) -> None:
        """Wait until every request sent is written (or its write failed). Bounded: each
        write is bounded by its link's stall timeout."""
        for rank in list(self._writers):
            self._writers.pop(rank).join()
        self._writing.clear()

    def receive(self, block: bool = True, until: float | None = None) -> Reply | None:
        if self._write_errors:
            self._raise_write_error()
        while True:
            reply = self._next(block, until)
            if reply is None or reply.seq not in self._abandoned:
                return reply
            # A late answer to a request given up on: its round is over.
            self._abandoned.discard(reply.seq)
            log.info("rank %d: discarding a late reply (seq %d)", reply.rank, reply.seq)

    def _next(self, block: bool, until: float | None) -> Reply | None:
        while True:
            if self._failed:
                return self._failed.popleft()
            owed = {rank: o for rank, o in self._owed.items() if o.tickets}
            if not owed and not self._relay_owed:
                raise MeshError("receive() with no request outstanding")
            dead, _ = self._members()
            now = time.monotonic()
            lost_relay = self._relay_failure(now) if self._relay_owed else None
            if lost_relay is not None:
                return lost_relay
            soonest = (min([d for _, _, d in self._relay_owed.values()])
                       if self._relay_owed else math.inf)
            if until is not None and until < soonest:
                soonest = until
            for rank, o in owed.items():
                if rank in dead:
                    return Reply(rank, None, self.dead[rank], o.pop())
                deadline = o.deadline()
                if deadline <= now:
                    reason = f"no answer within {o.tickets[0][1]:g} s (stalled)"
                    self.declare_dead(rank, reason)
                    return Reply(rank, None, self.group.dead.get(rank, reason), o.pop())
                if deadline < soonest:
                    soonest = deadline
            if until is not None and until <= now:
                return None
            wait = min(POLL_SECONDS, max(0.0, soonest - now)) if block else 0.0
            try:
                src, frame = self.group.recv(None, TAG_REPLY, timeout=wait)
            except PeerLostError:
                if not block:
                    return None
                continue  # nothing yet (or a death): look at the ledger again
            taken = self._take_in(src, frame, owed.get(src))
            if taken is not None:
                return taken

    def _take_in(self, src: int, frame: Mapping[str, Any],
                 owes: _Outstanding | None) -> Reply | None:
        """A reply frame from ``src``, checked at the boundary: its Reply, or None (discarded).

        What does not fit (no message's encoding, or not its request's schema:
        :mod:`meshkit.train._messages`) declares ``src`` dead with the reason
        and fails the request it owed.
        """
        try:
            reply = decode(frame)
        except ProtocolError as exc:
            if owes is None:
                log.warning("rank %d: discarding a reply frame that is no message: %s",
                            src, exc)
                return None
            self.declare_dead(src, protocol_reason(exc))
            return Reply(src, None, self.group.dead.get(src, protocol_reason(exc)), owes.pop())
        if "relay" in reply:
            relay_seq = reply.get("seq")
            # (A seq that is no integer cannot be a ticket: never a dict key.)
            entry = (self._relay_owed.pop(relay_seq, None) if isinstance(relay_seq, int)
                     else None)
            if entry is None or entry[0] != reply["relay"]:
                log.debug("discarding a stale reply from host relay %r", reply["relay"])
                return None
            return Reply(entry[1], reply, None, reply["seq"])
        if owes is None:
            log.debug("rank %d: discarding a reply to nothing it owes (seq %r)", src,
                      reply.get("seq"))
            return None
        head, _, request = owes.tickets[0]
        seq = reply.get("seq")
        if isinstance(seq, int) and not isinstance(seq, bool) and seq < head:
            log.debug("rank %d: discarding a stale reply (seq %d)", src, seq)
            return None
        try:
            # The boundary: past here no reply lacks a field or holds a wrong type.
            check_reply(request, reply, head)
        except ProtocolError as exc:
            self.declare_dead(src, protocol_reason(exc))
            return Reply(src, None, self.group.dead.get(src, protocol_reason(exc)), owes.pop())
        ticket = owes.pop()
        writer = self._writing.pop(ticket, None)
        if writer is not None:
            # The worker read the whole request, so the write has returned or is returning:
            # bounded by the thread's bookkeeping, never by the link.
            writer.join()
        return Reply(src, reply, None, ticket)

    def stop_all(self, ranks: Sequence[int]) -> None:
        """Tell workers the run is over (best effort: some may be gone)."""
        self.flush()  # after every request already sent, on each link
        for rank in self.live(ranks):
            try:
                self.group.send(rank, TAG_REQUEST, {"op": "stop", "seq": 0})
            except (PeerLostError, OSError):
                pass

    def close(self) -> None:
        self.flush()


@attrs.define
class LocalPool:
    """In-process workers: one :class:`Trainer` per rank, called directly.

    For tests and for strategies on a single machine without processes.
    ``fail(rank, request)`` may return a reason to simulate a lost worker
    (it is then dead for good); ``order``, a ``numpy.random.Generator``,
    picks which worker answers next (default: the oldest request first).
    ``log`` records every ``(rank, request)`` sent. ``direct`` hands each
    request to its trainer as it is, with no wire round trip and no log (a
    collective run's own trainer, for every round of a long run); replies
    are still checked at the boundary.
    """

    trainers: dict[int, Trainer]
    fail: Callable[[int, Mapping[str, Any]], str | None] | None = None
    order: np.random.Generator | None = None
    log: list[tuple[int, dict[str, Any]]] = attrs.Factory(list)
    direct: bool = False
    #: The most whole states (``state``/``gradients`` replies) alive at once.
    peak_held: int = 0
    #: Who is dead here: a ledger of the pool's own, decided where every one is.
    _members: Membership = attrs.Factory(lambda: Membership(0))
    _queue: dict[int, collections.deque[tuple[int, dict[str, Any]]]] = attrs.Factory(dict)
    _seq: int = 0
    _held: int = 0

    @classmethod
    def of(cls, task_factory: Callable[[], Any], ranks: Sequence[int], **kw: Any) -> LocalPool:
        return cls({r: Trainer(task_factory()) for r in ranks}, **kw)

    @property
    def dead(self) -> dict[int, str]:
        return self._members.dead()

    def live(self, ranks: Iterable[int]) -> list[int]:
        dead = self._members.view
        return [r for r in ranks if r in self.trainers and r not in dead]

    @property
    def relays(self) -> dict[str, list[int]]:
        return {}  # in-process workers: none behind a relay

    def send_relay(self, name: str, request: Mapping[str, Any], timeout: float | None) -> int:
        raise MeshError("a LocalPool has no host relays")

    def declare_dead(self, rank: int, reason: str) -> None:
        if self._members.declare_dead(rank, reason):
            log.warning("rank %d declared dead: %s", rank, reason)

    @property
    def pending(self) -> int:
        return sum(len(q) for q in self._queue.values())

    def send(self, rank: int, request: Mapping[str, Any], timeout: float | None) -> int:
        self._seq += 1
        if not self.direct:
            self.log.append((rank, dict(request)))
        if rank not in self.trainers:
            self.declare_dead(rank, f"rank {rank} is not a worker of this pool")
        self._queue.setdefault(rank, collections.deque()).append((self._seq, dict(request)))
        return self._seq

    def abandon(self, ticket: int) -> None:
        # In-process workers answer only when asked: an abandoned request is never run.
        for queue in self._queue.values():
            for item in list(queue):
                if item[0] == ticket:
                    queue.remove(item)

    def receive(self, block: bool = True, until: float | None = None) -> Reply | None:
        ranks = sorted((q[0][0], r) for r, q in self._queue.items() if q)
        if not ranks:
            raise MeshError("receive() with no request outstanding")
        if not block:
            return None  # in-process workers answer only when asked to
        pick = 0 if self.order is None else int(self.order.integers(len(ranks)))
        rank = ranks[pick][1]
        seq, request = self._queue[rank].popleft()
        why = self._members.reason(rank)
        if why is not None:
            return Reply(rank, None, why, seq)
        reason = self.fail(rank, request) if self.fail else None
        if reason:
            self.declare_dead(rank, reason)
            return Reply(rank, None, reason, seq)
        if self.direct:
            if request.get("op") == "set_state" or request.get("set_state"):
                # The trainer's own copy, as a worker process has: nothing a fit does
                # reaches the caller's model (once a round, not once a client).
                request = {**request, "state": {k: np.array(v, copy=True) if is_array(v)
                                                else v for k, v in request["state"].items()}}
            reply = self.trainers[rank].handle({**request, "seq": seq})
        else:
            # Round-trip through the wire encoding, so tests exercise it.
            reply = decode(encode(self.trainers[rank].handle(decode(encode({**request,
                                                                             "seq": seq})))))
        try:
            check_reply(request, reply, seq)  # the boundary, as GroupPool's
        except ProtocolError as exc:
            self.declare_dead(rank, protocol_reason(exc))
            return Reply(rank, None, self._members.reason(rank), seq)
        self._track(reply)
        return Reply(rank, reply, None, seq)

    def _track(self, reply: Mapping[str, Any]) -> None:
        """Count whole states handed out until the coordinator lets go of them."""
        for field in ("state", "gradients"):
            arrays = [v for v in (reply.get(field) or {}).values() if isinstance(v, np.ndarray)]
            if arrays:
                self._held += 1
                self.peak_held = max(self.peak_held, self._held)
                weakref.finalize(arrays[0], self._release)

    def _release(self) -> None:
        self._held -= 1

    def stop_all(self, ranks: Sequence[int]) -> None:
        pass

    def close(self) -> None:
        pass
