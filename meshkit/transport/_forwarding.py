"""The star's forwarding: the coordinator forwards worker-to-worker messages, one queue per destination.

In a star, workers only ever dial the coordinator, so a message from one
worker to another arrives at rank 0 and is forwarded. Each destination has
its own queue and writer thread, so a rank that stops reading holds up only
what is sent *to* it: the sender's later frames, its reduce contributions and
every other rank's traffic carry on. A message is written on the spot, on
the thread that received it, when nothing is queued for its destination and
the transport says the write cannot wait (:meth:`Links.relay_now`); else it
is queued. A queue takes :data:`RELAY_QUEUE` messages and
:data:`RELAY_QUEUE_BYTES` bytes (always at least one message) before the
sender's reader waits for room; a queue that stays full for half the stall
timeout means its destination takes nothing, and that rank is declared dead.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

from meshkit.errors import PeerLostError, WireError
from meshkit.transport._contract import Links
from meshkit.transport._ledger import Ledger
from meshkit.transport._message import Message

__all__ = ["StarForwarder", "RELAY_QUEUE", "RELAY_QUEUE_BYTES", "RELAY_IDLE"]

log = logging.getLogger(__name__)

#: Messages a destination's queue takes before the sender's reader waits.
RELAY_QUEUE = 64
#: Bytes a destination's queue takes before the sender's reader waits.
RELAY_QUEUE_BYTES = 64 << 20
#: A relay writer with nothing to send for this long ends (a new one starts
#: with the next message).
RELAY_IDLE = 2.0


def _relay_size(message: Message) -> int:
    """Bytes a queued relay holds (its received frame's body; 0 if not known)."""
    return int(getattr(message.raw, "nbytes", 0) or 0)


class StarForwarder:
    """A star coordinator's per-destination relay queues and their writer threads."""

    def __init__(self, ledger: Ledger, links: Links,
                 declare_dead: Callable[[int, str], None], timeout: float) -> None:
        self._ledger = ledger
        self._links = links
        self._declare_dead = declare_dead
        self._timeout = timeout
        # Per-destination queues, their queued bytes, the destinations with a
        # writer thread and those being written to, all under ``_cv`` (``with
        # self._lock``, the cv's own lock, on the per-frame path: C calls).
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._out: dict[int, collections.deque[Message]] = {}
        self._bytes: dict[int, int] = {}
        self._writers: set[int] = set()
        self._sending: set[int] = set()

    def relay(self, message: Message) -> None:
        """Forward ``message`` (not for this rank) towards ``message.dst``."""
        # Only the star's coordinator relays; anything else is a routing bug or
        # a peer misbehaving, and is dropped loudly rather than bounced around.
        ledger = self._ledger
        if not ledger.is_coordinator:
            log.warning("rank %d dropped a message for rank %d from rank %d: not a relay",
                        ledger.rank, message.dst, message.src)
            return
        if ledger.hold(message):
            return
        self._queue(message)

    def forget(self, rank: int) -> None:
        """``rank`` died: nothing queued for it can be delivered; waiting readers move on."""
        with self._cv:
            self._out.pop(rank, None)
            self._bytes.pop(rank, None)
            self._cv.notify_all()

    def close(self) -> None:
        """The group closed: drop every queue and wake every writer and waiting reader."""
        with self._cv:
            self._out.clear()
            self._bytes.clear()
            self._cv.notify_all()

    def _queue(self, message: Message) -> None:
        """Queue ``message`` for its destination's relay writer.

        Called on the reader thread of the rank that sent it. It returns at
        once unless that destination's queue is full; then it waits for room,
        which holds up only this sender. A queue that stays full for half the
        stall timeout means its destination takes nothing: that rank is
        declared dead (the sender and every other rank carry on).
        """
        dst = message.dst
        ledger = self._ledger
        with self._lock:
            # Nothing queued or being written for ``dst``: try writing it here.
            inline = not self._out.get(dst) and dst not in self._sending
            if inline:
                self._sending.add(dst)
        if inline:
            try:
                if self._links.relay_now(dst, message):
                    return
            except (PeerLostError, WireError) as exc:
                log.warning("relaying a message from rank %d to rank %d failed: %s",
                            message.src, dst, exc)
                return
            finally:
                with self._lock:
                    self._sending.discard(dst)
                    self._cv.notify_all()
        size = _relay_size(message)
        patience = self._timeout / 2
        deadline = time.monotonic() + patience
        start = False
        full = ""
        with self._cv:
            while True:
                if ledger.closed or ledger.is_dead(dst):
                    return
                queue = self._out.setdefault(dst, collections.deque())
                queued = self._bytes.get(dst, 0)
                if not queue or (len(queue) < RELAY_QUEUE
                                 and queued + size <= RELAY_QUEUE_BYTES):
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    full = f"{len(queue)} message(s), {queued} bytes"
                    break
                self._cv.wait(remaining)
            if not full:
                queue.append(message)
                self._bytes[dst] = queued + size
                if dst not in self._writers:
                    self._writers.add(dst)
                    start = True
                self._cv.notify_all()
        if full:
            self._declare_dead(dst, f"took none of the {full} relayed to it for {patience:g} s "
                                    f"(half the stall timeout); dropped as stalled")
            return
        if start:
            threading.Thread(target=self._writer, args=(dst,), daemon=True,
                             name=f"meshkit-relay-r{ledger.rank}-to-{dst}").start()

    def _writer(self, dst: int) -> None:
        """Send the messages queued for ``dst`` in order; end when idle or dead."""
        ledger = self._ledger
        while True:
            with self._cv:
                idle_until = time.monotonic() + RELAY_IDLE
                while True:
                    queue = self._out.get(dst)
                    if ledger.closed or queue is None:
                        break
                    if queue:
                        if dst not in self._sending:
                            break
                        # A reader is writing one inline; it notifies when done.
                        self._cv.wait(1.0)
                        continue
                    remaining = idle_until - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cv.wait(remaining)
                if not queue or ledger.closed:
                    self._writers.discard(dst)
                    if queue is not None and not queue:
                        del self._out[dst]
                        self._bytes.pop(dst, None)
                    return
                message = queue.popleft()
                self._bytes[dst] -= _relay_size(message)
                self._sending.add(dst)
                self._cv.notify_all()
            try:
                self._links.transmit(dst, message, None)
            except (PeerLostError, WireError) as exc:
                log.log(logging.DEBUG if ledger.closed else logging.WARNING,
                        "relaying a message from rank %d to rank %d failed: %s",
                        message.src, dst, exc)
            finally:
                with self._cv:
                    self._sending.discard(dst)
                    self._cv.notify_all()
