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

**Unread bytes are bounded** per (source, tag): the messages queued behind
the oldest unread one from a source on a tag may hold at most
``max_unread`` bytes (:data:`MAX_UNREAD_BYTES` by default; each message
counts its frame's body plus :data:`MESSAGE_OVERHEAD` for the objects that
hold it). The oldest is never counted, so one frame of any size the
transport accepts (``max_frame_bytes``) always fits: a model of many MiB on
the request/reply tags is read before the next one arrives, and a tag the
engine reads is drained as it comes. A sender past the bound is flooding a
tag this rank does not read as fast (or at all): it is in breach, like any
protocol violation. Its unread messages on that tag are discarded at once,
it is declared dead, named with the bound (``on_breach``), and what it still
sends (relayed, say) is dropped until it connects again. So is a
source with unread messages on more than :data:`MAX_UNREAD_TAGS` tags at
once (spreading a flood over many tags). What one source can make this rank
hold is therefore at most ``MAX_UNREAD_TAGS * (max_frame_bytes +
max_unread)``, and one tag's flood ``max_frame_bytes + max_unread``.
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Callable, Mapping

from meshkit.errors import PeerLostError
from meshkit.transport._ledger import Ledger
from meshkit.transport._message import Message
from meshkit.transport._timeouts import deadline_after, remaining, shown

__all__ = ["Mailboxes", "MAX_UNREAD_BYTES", "MAX_UNREAD_TAGS", "MESSAGE_OVERHEAD"]

log = logging.getLogger(__name__)

#: Takes a diverted message's payload on the delivering thread: True when
#: taken, False to have it queued for ``recv`` instead.
Handler = Callable[[Mapping[str, Any]], bool]

#: Bytes the messages behind the oldest unread one from a source on a tag may hold.
MAX_UNREAD_BYTES = 64 << 20
#: Tags one source may have unread messages on at once (the kernel's and the
#: trainer's use under 20); a message on one more is a breach.
MAX_UNREAD_TAGS = 64
#: What a queued message costs beyond its body (its Message, dict and frame
#: objects), so a flood of empty frames meets the bound too.
MESSAGE_OVERHEAD = 4096


def _size(message: Message) -> int:
    """The bytes ``message`` holds while queued: its received body, else its arrays.

    A frame a placer took (``raw.placed``: the mesh ring's segments) landed in
    a buffer its receiver allocated beforehand and holds nothing new.
    """
    raw = message.raw
    if raw is not None:
        if getattr(raw, "placed", False) is True:
            return MESSAGE_OVERHEAD
        nbytes = getattr(raw, "nbytes", None)
        if type(nbytes) is int and nbytes > 0:
            return nbytes + MESSAGE_OVERHEAD
    total = MESSAGE_OVERHEAD
    for value in message.payload.values():
        size = getattr(value, "nbytes", 0)
        total += size if isinstance(size, int) else 0
    return total


class Mailboxes:
    """One rank's received messages, per tag, under the ledger's lock."""

    def __init__(self, ledger: Ledger, timeout: float, *,
                 max_unread: int = MAX_UNREAD_BYTES,
                 on_breach: Callable[[int, str], None] | None = None) -> None:
        self._ledger = ledger
        self._cv = ledger.cv
        self._lock = ledger.lock
        self._timeout = timeout
        self.max_unread = int(max_unread)
        self._on_breach = on_breach
        self._inbox: dict[int, collections.deque[Message]] = collections.defaultdict(
            collections.deque)
        self._handlers: dict[tuple[int, int], Handler] = {}
        #: (src, tag) -> [the sum, the sizes of its queued messages oldest first]
        #: (kept when it empties: a tag read lock-step refills it every message).
        self._unread: dict[tuple[int, int], list[Any]] = {}
        #: src -> how many tags it has messages queued on.
        self._tags: dict[int, int] = {}
        #: Sources found in breach: whatever still arrives from them is dropped
        #: (a star worker's relayed sender, whose link is the coordinator's).
        self._offenders: set[int] = set()

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
            breach = self._queue(message) if handler is None else None
        if handler is None:
            if breach is not None:
                self._breached(message.src, breach)
            return
        try:
            taken = handler(message.payload)
        except Exception:  # noqa: BLE001 (a handler bug must not take the reader down)
            log.exception("rank %d: the handler for tag 0x%X from rank %d failed",
                          self._ledger.rank, message.tag, message.src)
            taken = False
        if not taken:
            with self._cv:
                if self._ledger.closed:
                    return
                breach = self._queue(message)
            if breach is not None:
                self._breached(message.src, breach)

    def _queue(self, message: Message) -> str | None:
        """Queue ``message`` (lock held); why its sender is in breach instead, or None."""
        src = message.src
        if self._offenders and src in self._offenders:
            return None  # already in breach (a relayed sender the relay still forwards)
        key = (src, message.tag)
        size = _size(message)
        entry = self._unread.get(key)
        if entry is None or not entry[1]:
            tags = self._tags.get(src, 0)
            if tags >= MAX_UNREAD_TAGS:
                self._offenders.add(src)
                self._discard_source(src)
                return (f"protocol error: sent messages on more than {MAX_UNREAD_TAGS} tags "
                        f"that rank {self._ledger.rank} did not read (MAX_UNREAD_TAGS)")
            self._tags[src] = tags + 1
            if entry is None:
                entry = self._unread[key] = [0, collections.deque()]
        elif entry[0] - entry[1][0] + size > self.max_unread:
            behind = entry[0] - entry[1][0] + size
            count = len(entry[1])
            self._offenders.add(src)
            self._discard(src, message.tag)
            return (f"protocol error: sent {count + 1} messages on tag 0x{message.tag:X} "
                    f"that rank {self._ledger.rank} did not read, {behind} bytes behind the "
                    f"oldest: past the unread bound of {self.max_unread} bytes per (source, "
                    f"tag)")
        entry[1].append(size)
        entry[0] += size
        self._inbox[message.tag].append(message)
        self._cv.notify_all()
        return None

    def _taken(self, message: Message) -> None:
        """``message`` left the mailbox (lock held): its bytes no longer count."""
        entry = self._unread.get((message.src, message.tag))
        if entry and entry[1]:
            entry[0] -= entry[1].popleft()
            if not entry[1]:
                self._emptied(message.src)

    def _emptied(self, src: int) -> None:
        """One of ``src``'s tags has nothing queued any more (lock held)."""
        left = self._tags.get(src, 1) - 1
        if left > 0:
            self._tags[src] = left
        else:
            self._tags.pop(src, None)

    def _discard(self, src: int, tag: int) -> None:
        """Drop every queued message from ``src`` on ``tag`` (lock held)."""
        queue = self._inbox.get(tag)
        if queue:
            self._inbox[tag] = collections.deque(m for m in queue if m.src != src)
        entry = self._unread.pop((src, tag), None)
        if entry is not None and entry[1]:
            self._emptied(src)

    def _discard_source(self, src: int) -> None:
        """Drop every queued message from ``src``, on every tag (lock held)."""
        for src_tag in [key for key in self._unread if key[0] == src]:
            self._discard(*src_tag)

    def _breached(self, src: int, reason: str) -> None:
        log.warning("rank %d: rank %d is in breach: %s", self._ledger.rank, src, reason)
        if self._on_breach is not None:
            self._on_breach(src, reason)

    def forgive(self, src: int) -> None:
        """``src`` connected again (a restarted node): queue its messages again."""
        with self._lock:
            self._offenders.discard(src)

    def unread_bytes(self, src: int, tag: int) -> int:
        """Bytes queued from ``src`` on ``tag`` (the oldest message included)."""
        with self._lock:
            entry = self._unread.get((src, tag))
            return 0 if entry is None else int(entry[0])

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
                self._discard(src, tag)
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
                            self._taken(message)
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
                        raise PeerLostError(f"waiting for {label}: {'; '.join(reasons)}")
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
                            self._taken(message)
                            return message
                    for message in [m for m in queue if m.src in dead]:
                        queue.remove(message)
                        self._taken(message)
                if not pending:
                    return None
                if ledger.closed:
                    raise PeerLostError("the group was closed during a reduce round")
                left = remaining(deadline)
                if left <= 0:
                    return None
                self._cv.wait(min(left, 3600.0))
