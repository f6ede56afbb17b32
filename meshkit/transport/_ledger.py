"""Who is in the mesh: joined ranks, direct links, and the dead ledger.

Every death is recorded here, once: a rank declared dead stays dead until
whoever runs the rounds takes it back (:meth:`Ledger.take_back`), and only
between rounds, because a rank that missed a round no longer holds the model
the others hold. A dead rank whose node connects again (a restarted worker)
is *returning*: linked, its messages queued, but dead for routing and for
every wait until it is taken back. Routing asks this ledger for the next hop,
and every wait (a ``recv``, a reduce round, ``wait_for_workers``) watches
its condition, so a death wakes whoever was waiting for that rank.

A star's coordinator also keeps here the few messages relayed to a rank that
has not joined yet: they are handed back when it joins and freed when it is
declared dead, under the same lock that decides which of the two happened.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Mapping

from meshkit.errors import PeerLostError
from meshkit.transport._message import Message
from meshkit.transport._timeouts import remaining

__all__ = ["Ledger", "MAX_HELD", "MAX_HELD_BYTES", "describe_dead"]

log = logging.getLogger(__name__)

#: Relayed messages held per rank that has not joined yet (star coordinator).
MAX_HELD = 64
#: Bytes those messages may hold (always at least one message): without it
#: an insider could park 64 frames of ``max_frame_bytes`` per missing rank.
MAX_HELD_BYTES = 64 << 20


def describe_dead(dead: Mapping[int, str]) -> str:
    """A dead ledger as an error message quotes it ("rank 2: why; rank 3: why")."""
    return "; ".join(f"rank {r}: {why}" for r, why in sorted(dead.items())) or "none"


class Ledger:
    """One rank's view of the mesh; ``cv`` guards it and wakes every waiter on a change."""

    def __init__(self, rank: int, world_size: int, *, is_star: bool) -> None:
        self.rank = rank
        self.world_size = world_size
        self.is_star = is_star
        #: Guards everything here and the mailboxes; notified on every change.
        #: ``lock`` is its lock: ``with ledger.lock`` where a frame passes
        #: (C calls), ``with ledger.cv`` where a wait or a notify follows.
        self.lock = threading.RLock()
        self.cv = threading.Condition(self.lock)
        self._dead: dict[int, str] = {}
        self._joined: set[int] = set()
        self._links: set[int] = set()
        self._held: dict[int, collections.deque[Message]] = {}
        self._held_bytes: dict[int, int] = {}
        #: Dead ranks linked again since (a restarted node), until taken back.
        self._returning: set[int] = set()
        self._closed = False

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    # -- reading --------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def is_dead(self, rank: int) -> bool:
        """Whether ``rank`` is dead, without the lock (a death is never undone)."""
        return rank in self._dead

    def reason(self, rank: int) -> str | None:
        """Why ``rank`` was declared dead, or None."""
        with self.cv:
            return self._dead.get(rank)

    def dead(self) -> dict[int, str]:
        with self.cv:
            return dict(self._dead)

    def joined(self) -> list[int]:
        with self.cv:
            return sorted(self._joined)

    def live_ranks(self) -> list[int]:
        """Coordinator: joined workers not dead. Worker: linked ranks not dead."""
        with self.cv:
            if self.is_coordinator:
                return sorted(r for r in self._joined if r not in self._dead)
            return sorted(r for r in self._links if r not in self._dead)

    def returning(self) -> list[int]:
        """Dead ranks whose node connected again, waiting to be taken back."""
        with self.cv:
            return sorted(self._returning)

    def describe(self) -> str:
        """The ledger as an error message quotes it (:func:`describe_dead`)."""
        return describe_dead(self.dead())

    def unreachable(self, src: int) -> str | None:
        """Why ``src`` can no longer send to us, or None. Caller holds ``cv``."""
        if src in self._dead:
            return f"rank {src} is dead: {self._dead[src]}"
        if self.is_star and not self.is_coordinator and 0 in self._dead:
            return f"the coordinator (rank 0) is lost: {self._dead[0]}"
        return None

    def next_hop(self, dst: int) -> int:
        """The rank a message for ``dst`` goes to first, or ``PeerLostError`` saying why none."""
        with self.lock:
            if self._closed:
                raise PeerLostError(f"rank {self.rank}: the group is closed")
            if dst in self._dead:
                raise PeerLostError(f"rank {dst} is dead: {self._dead[dst]}")
            if dst in self._links:
                return dst
            if self.is_star and not self.is_coordinator:
                if 0 in self._dead:
                    raise PeerLostError(
                        f"the coordinator (rank 0) is lost: {self._dead[0]}")
                return 0
            if self.is_coordinator:
                raise PeerLostError(
                    f"rank {dst} has not joined the mesh (joined: {sorted(self._joined)})")
            raise PeerLostError(f"rank {self.rank} has no connection to rank {dst}")

    # -- changing -------------------------------------------------------------

    def link(self, rank: int) -> list[Message]:
        """A direct link to ``rank`` is up; on the coordinator it joined: its held messages."""
        with self.cv:
            self._links.add(rank)
            if rank in self._dead:
                self._returning.add(rank)
            held: list[Message] = []
            if self.is_coordinator:
                self._joined.add(rank)
                held = list(self._held.pop(rank, ()))
                self._held_bytes.pop(rank, None)
            self.cv.notify_all()
        return held

    def hold(self, message: Message) -> bool:
        """Keep ``message`` until its destination joins; False if it joined or is dead.

        Workers join in any order: a few messages for a rank that has not
        joined yet wait here instead of being dropped (past :data:`MAX_HELD`
        they are dropped, loudly).
        """
        dst = message.dst
        with self.lock:  # every relayed frame asks
            if dst in self._joined or dst in self._dead:
                return False
            held = self._held.setdefault(dst, collections.deque())
            size = int(getattr(message.raw, "nbytes", 0) or 0)
            queued = self._held_bytes.get(dst, 0)
            if len(held) < MAX_HELD and (not held or queued + size <= MAX_HELD_BYTES):
                held.append(message)
                self._held_bytes[dst] = queued + size
                return True
        log.warning("dropped a message from rank %d to rank %d: rank %d has not "
                    "joined and %d messages (%d bytes) already wait for it; at most %d "
                    "messages or %d bytes are held", message.src, dst, dst, len(held), queued,
                    MAX_HELD, MAX_HELD_BYTES)
        return True

    def record_death(self, rank: int, reason: str) -> bool:
        """Record ``rank`` as dead; False if it already is, or is this rank."""
        with self.cv:
            if rank in self._returning:
                # The returning node's new link failed before it was taken back.
                self._returning.discard(rank)
                self._dead[rank] = reason
                self.cv.notify_all()
                return True
            if rank in self._dead or rank == self.rank:
                return False
            self._dead[rank] = reason
            # Messages held for a rank that never joined can never be delivered.
            self._held.pop(rank, None)
            self._held_bytes.pop(rank, None)
            self.cv.notify_all()
        return True

    def take_back(self) -> list[int]:
        """Clear every returning rank from the dead ledger; the ranks taken back.

        Call it only between rounds: a rank taken back mid-round could be
        handed work by a round that already gave its share to others.
        """
        with self.cv:
            back = sorted(self._returning)
            for rank in back:
                self._dead.pop(rank, None)
            self._returning.clear()
            if back:
                self.cv.notify_all()
        return back

    def close(self) -> bool:
        """Mark the group closed and wake every waiter; False if it already was."""
        with self.cv:
            if self._closed:
                return False
            self._closed = True
            self.cv.notify_all()
        return True

    # -- waiting --------------------------------------------------------------

    def wait_for_workers(self, deadline: float, waited: str) -> list[int]:
        """Block until every worker joined or is dead; the joined ranks.

        ``waited`` is the timeout as the error quotes it.
        """
        expected = set(range(1, self.world_size))
        with self.cv:
            while True:
                missing = expected - self._joined - set(self._dead)
                if not missing:
                    return sorted(self._joined)
                if self._closed:
                    raise PeerLostError("the group was closed while waiting for workers")
                left = remaining(deadline)
                if left <= 0:
                    raise PeerLostError(
                        f"waited {waited} for {self.world_size - 1} "
                        f"worker(s); rank(s) {sorted(missing)} never joined (joined: "
                        f"{sorted(self._joined)}); check their peers/secret/world, or "
                        f"raise the timeout")
                self.cv.wait(min(left, 3600.0))
