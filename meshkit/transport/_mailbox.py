"""Every message for this rank waits here, by tag, until a receive takes it.

Messages are kept in arrival order per tag and taken by (tag, source), so
frames are delivered in arrival order per (source, tag). A wait ends when a
matching message is there, when every rank it could come from is dead (the
ledger's condition wakes it), when the group closes, or at its deadline: a
lost peer is always a :class:`~meshkit.PeerLostError`, never a hang. Frames a
peer completed before dying are still taken first.

A (source, tag) pair can instead be *diverted* to a handler
(:meth:`Mailboxes.divert`): each such message is then handed to it on the
thread that delivered it, without a wake-up of a waiting receiver. The
handler takes it (returns True) or declines it (False: it is queued here as
usual); a handler that declines one message declines every later one, so
per-sender order holds either way.
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Callable, Mapping

from meshkit.errors import PeerLostError
from meshkit.transport._ledger import Ledger
from meshkit.transport._message import Message
from meshkit.transport._timeouts import deadline_after, remaining, shown

__all__ = ["Mailboxes"]

log = logging.getLogger(__name__)

#: Takes a diverted message's payload on the delivering thread: True when
#: taken, False to have it queued for ``recv`` instead.
Handler = Callable[[Mapping[str, Any]], bool]


class Mailboxes:
    """One rank's received messages, per tag, under the ledger's lock."""

    def __init__(self, ledger: Ledger, timeout: float) -> None:
        self._ledger = ledger
        self._cv = ledger.cv
        self._lock = ledger.lock
        self._timeout = timeout
        self._inbox: dict[int, collections.deque[Message]] = collections.defaultdict(
            collections.deque)
        self._handlers: dict[tuple[int, int], Handler] = {}

    def put(self, message: Message) -> None:
        """Keep ``message`` for a receive, or hand it to its diverted handler.

        Dropped once the group is closed. A handler runs on this (the
        delivering) thread, outside the lock; one that raises is logged and
        the message queued, so a handler bug never loses a frame silently.
        """
        with self._lock:  # the cv's own lock (C calls per frame); notify needs it held
            if self._ledger.closed:
                return
            handler = self._handlers.get((message.src, message.tag)) if self._handlers else None
            if handler is None:
                self._inbox[message.tag].append(message)
                self._cv.notify_all()
                return
        try:
            taken = handler(message.payload)
        except Exception:  # noqa: BLE001 (a handler bug must not take the reader down)
            log.exception("rank %d: the handler for tag 0x%X from rank %d failed",
                          self._ledger.rank, message.tag, message.src)
            taken = False
        if not taken:
            with self._cv:
                if not self._ledger.closed:
                    self._inbox[message.tag].append(message)
                    self._cv.notify_all()

    def divert(self, src: int, tag: int, handler: Handler) -> list[Mapping[str, Any]]:
        """Hand every later message with ``tag`` from ``src`` to ``handler``.

        Returns the payloads of such messages already queued, oldest first
        (taken out of the mailbox, atomically with installing the handler),
        so the caller serves them before anything the handler is given.
        """
        with self._cv:
            key = (src, tag)
            if key in self._handlers:
                raise ValueError(f"messages with tag 0x{tag:X} from rank {src} are already "
                                 f"diverted")
            self._handlers[key] = handler
            queue = self._inbox.get(tag)
            if not queue:
                return []
            taken = [m for m in queue if m.src == src]
            if taken:
                self._inbox[tag] = collections.deque(m for m in queue if m.src != src)
            return [m.payload for m in taken]

    def undivert(self, src: int, tag: int, handler: Handler) -> None:
        """Queue messages with ``tag`` from ``src`` for ``recv`` again (if ``handler`` had them)."""
        with self._cv:
            if self._handlers.get((src, tag)) == handler:
                del self._handlers[(src, tag)]

    def take(self, tag: int, sources: set[int] | None, timeout: float | None,
             what: str | None = None, *, watch: frozenset[int] = frozenset()) -> Message:
        """Pop the first message with ``tag`` from one of ``sources`` (None: any).

        ``watch``: ranks whose death also ends the wait (a collective's other
        participants: one of them lost means the awaited message never comes).
        """
        ledger = self._ledger
        deadline = deadline_after(timeout, self._timeout)
        with self._cv:
            while True:
                queue = self._inbox.get(tag)
                if queue:
                    for i, message in enumerate(queue):
                        if sources is None or message.src in sources:
                            del queue[i]
                            return message
                if ledger.closed:
                    raise PeerLostError(f"rank {ledger.rank}: the group was closed while waiting")
                label = what or f"a message with tag 0x{tag:X}"
                lost = [reason for reason in map(ledger.unreachable, sorted(watch)) if reason]
                if lost:
                    raise PeerLostError(f"waiting for {label}: {'; '.join(lost)}")
                if sources is not None:
                    reasons = [ledger.unreachable(s) for s in sources]
                    if all(reasons):
                        raise PeerLostError(f"waiting for {label}: {'; '.join(r for r in reasons if r)}")
                elif (ledger.world_size > 1
                      and len(ledger.dead()) >= ledger.world_size - 1):
                    raise PeerLostError(
                        f"waiting for {label} from any rank: every other rank is dead "
                        f"({ledger.describe()})")
                left = remaining(deadline)
                if left <= 0:
                    who = "any rank" if sources is None else "rank " + ", ".join(
                        str(s) for s in sorted(sources))
                    raise PeerLostError(
                        f"rank {ledger.rank}: waiting for {label} from {who}: nothing arrived "
                        f"within {shown(timeout, self._timeout)}; the peer stalled or is gone "
                        f"(raise the timeout if it is just slow)")
                self._cv.wait(min(left, 3600.0))

    def take_first(self, tag: int, pending: set[int], deadline: float) -> Message | None:
        """The next message with ``tag`` from a rank in ``pending``, or None.

        None when every pending rank has sent or died, or at ``deadline``.
        Ranks that die leave ``pending`` (it is updated in place), and their
        messages with ``tag`` are discarded: only survivors' messages count.
        """
        ledger = self._ledger
        with self._cv:
            while True:
                dead = ledger.dead()
                pending -= set(dead)
                queue = self._inbox.get(tag)
                if queue:
                    for i, message in enumerate(queue):
                        if message.src in dead:
                            continue
                        if message.src in pending:
                            del queue[i]
                            return message
                    for message in [m for m in queue if m.src in dead]:
                        queue.remove(message)
                if not pending:
                    return None
                if ledger.closed:
                    raise PeerLostError("the group was closed during a reduce round")
                left = remaining(deadline)
                if left <= 0:
                    return None
                self._cv.wait(min(left, 3600.0))
