"""Routing and waiting over a rank's membership: direct links, held messages, the next hop.

Who is in and who is dead is the membership's to decide
(:class:`~meshkit.transport._membership.Membership`, ``_membership.py``): the
ledger keeps one, shares its lock with it, and only asks it. A dead rank
whose node connects again (a restarted worker) is *returning*: linked, its
messages queued, but dead for routing and for every wait until it is taken
back. Routing asks this ledger for the next hop, and every wait (a ``recv``,
``wait_for_workers``) watches its condition, so a death wakes whoever was
waiting for that rank.

A star's coordinator also keeps here the few messages relayed to a rank that
has not joined yet: they are handed back when it joins and freed when it is
declared dead, under the same lock that decides which of the two happened.
"""

from __future__ import annotations

import collections
import logging
import threading
from meshkit.errors import PeerLostError
from meshkit.transport._membership import Membership, describe_dead
from meshkit.transport._message import Message
from meshkit.transport._timeouts import remaining

__all__ = ["Ledger", "MAX_HELD", "MAX_HELD_BYTES", "describe_dead"]

log = logging.getLogger(__name__)

#: Relayed messages held per rank that has not joined yet (star coordinator).
MAX_HELD = 64
#: Bytes those messages may hold (always at least one message): without it
#: an insider could park 64 frames of ``max_frame_bytes`` per missing rank.
MAX_HELD_BYTES = 64 << 20


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
        #: Who is in and who is dead: decided there, under this ledger's lock.
        self.members = Membership(rank, cv=self.cv)
        self._links: set[int] = set()
        self._held: dict[int, collections.deque[Message]] = {}
        self._held_bytes: dict[int, int] = {}
        self._closed = False

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    # -- reading --------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def is_dead(self, rank: int) -> bool:
        """Whether ``rank`` is dead, without the lock (one lookup; the per-frame path)."""
        return rank in self.members.view

    def reason(self, rank: int) -> str | None:
        """Why ``rank`` was declared dead, or None."""
        return self.members.reason(rank)

    def dead(self) -> dict[int, str]:
        return self.members.dead()

    def joined(self) -> list[int]:
        """Coordinator: the workers that joined. Worker: none (it counts links)."""
        return self.members.joined() if self.is_coordinator else []

    def live_ranks(self) -> list[int]:
        """Coordinator: joined workers not dead. Worker: linked ranks not dead."""
        with self.cv:
            if self.is_coordinator:
                return self.members.live(self.members.joined())
            dead = self.members.view
            return sorted(r for r in self._links if r not in dead)

    def returning(self) -> list[int]:
        """Dead ranks whose node connected again, waiting to be taken back."""
        return self.members.returning()

    def describe(self) -> str:
        """The ledger as an error message quotes it (:func:`describe_dead`)."""
        return self.members.describe()

    def unreachable(self, src: int) -> str | None:
        """Why ``src`` can no longer send to us, or None. Caller holds ``cv``."""
        dead = self.members.view
        if src in dead:
            return f"rank {src} is dead: {dead[src]}"
        if self.is_star and not self.is_coordinator and 0 in dead:
            return f"the coordinator (rank 0) is lost: {dead[0]}"
        return None

    def next_hop(self, dst: int) -> int:
        """The rank a message for ``dst`` goes to first, or ``PeerLostError`` saying why none."""
        dead = self.members.view
        with self.lock:
            if self._closed:
                raise PeerLostError(f"rank {self.rank}: the group is closed")
            if dst in dead:
                raise PeerLostError(f"rank {dst} is dead: {dead[dst]}")
            if dst in self._links:
                return dst
            if self.is_star and not self.is_coordinator:
                if 0 in dead:
                    raise PeerLostError(
                        f"the coordinator (rank 0) is lost: {dead[0]}")
                return 0
            if self.is_coordinator:
                raise PeerLostError(
                    f"rank {dst} has not joined the mesh (joined: {self.members.joined()})")
            raise PeerLostError(f"rank {self.rank} has no connection to rank {dst}")

    # -- changing (membership itself changes in _membership.py) ----------------

    def link(self, rank: int) -> list[Message]:
        """A direct link to ``rank`` is up; on the coordinator it joined: its held messages.

        A dead rank linked again is returning (:meth:`Membership.join`); on a
        worker, whose view counts links rather than joins, too.
        """
        with self.cv:
            self._links.add(rank)
            self.members.join(rank)
            held: list[Message] = []
            if self.is_coordinator:
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
            if dst in self.members.view or self.members.has_joined(dst):
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

    def record_death(self, rank: int, reason: str, *, left: bool = False) -> bool:
        """Have the membership declare ``rank`` dead (:meth:`Membership.declare_dead`).

        False if it already is, or is this rank. Messages held for a rank
        that never joined can never be delivered: freed under the same lock.
        """
        with self.cv:
            if not self.members.declare_dead(rank, reason, left=left):
                return False
            self._held.pop(rank, None)
            self._held_bytes.pop(rank, None)
        return True

    def take_back(self) -> list[int]:
        """Have the membership take every returning rank back (:meth:`Membership.take_back`).

        Call it only between rounds: a rank taken back mid-round could be
        handed work by a round that already gave its share to others.
        """
        return self.members.take_back()

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
                joined = self.members.joined()
                missing = expected - set(joined) - set(self.members.view)
                if not missing:
                    return joined
                if self._closed:
                    raise PeerLostError("the group was closed while waiting for workers")
                left = remaining(deadline)
                if left <= 0:
                    raise PeerLostError(
                        f"waited {waited} for {self.world_size - 1} "
                        f"worker(s); rank(s) {sorted(missing)} never joined (joined: "
                        f"{joined}); check their peers/secret/world, or "
                        f"raise the timeout")
                self.cv.wait(min(left, 3600.0))
