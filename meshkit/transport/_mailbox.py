"""Every message for this rank waits here, by tag, until a receive takes it.

Messages are kept in arrival order per tag and taken by (tag, source), so
frames are delivered in arrival order per (source, tag). A wait ends when a
matching message is there, when every rank it could come from is dead (the
ledger's condition wakes it), when the group closes, or at its deadline: a
lost peer is always a :class:`~meshkit.PeerLostError`, never a hang. Frames a
peer completed before dying are still taken first.
"""

from __future__ import annotations

import collections

from meshkit.errors import PeerLostError
from meshkit.transport._ledger import Ledger
from meshkit.transport._message import Message
from meshkit.transport._timeouts import deadline_after, remaining, shown

__all__ = ["Mailboxes"]


class Mailboxes:
    """One rank's received messages, per tag, under the ledger's lock."""

    def __init__(self, ledger: Ledger, timeout: float) -> None:
        self._ledger = ledger
        self._cv = ledger.cv
        self._timeout = timeout
        self._inbox: dict[int, collections.deque[Message]] = collections.defaultdict(
            collections.deque)

    def put(self, message: Message) -> None:
        """Keep ``message`` for a receive (dropped once the group is closed)."""
        with self._cv:
            if self._ledger.closed:
                return
            self._inbox[message.tag].append(message)
            self._cv.notify_all()

    def take(self, tag: int, sources: set[int] | None, timeout: float | None,
             what: str | None = None) -> Message:
        """Pop the first message with ``tag`` from one of ``sources`` (None: any)."""
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
