"""Who is in, who is dead and why, and who is taken back: the one place any of it changes.

Rule: a rank is *dead* from the moment it is declared so
(:meth:`Membership.declare_dead`) until it is *taken back*
(:meth:`Membership.take_back`), and nothing else adds to or clears the dead
ledger. Whoever notices a loss (a transport's lost link, a stall past a
request's deadline, a mailbox breach, a reply that breaks its schema, a
relay's news) says so through the owner of a membership -- the
:class:`~meshkit.transport.Group` (``group.declare_dead``), a pool, a host
relay -- and reads the verdict back from it; none keeps a ledger of its own
(``tests/transport/test_membership.py`` holds every module to this).

* **Joining.** :meth:`Membership.join` records a rank whose handshake
  completed. A dead rank that joins again (a restarted node) is
  *returning*: joined, but still dead for routing and for every wait until
  it is taken back.
* **Death and goodbye.** A death is recorded once, with its reason (a second
  declaration of the same death is ignored, the first reason stands); a rank
  that said goodbye on purpose is declared dead with ``left=True``, which
  :meth:`Membership.left` reports apart from the ranks that died. A
  returning rank declared dead again (its new link failed before it was
  taken back) is dead again, with the new reason. This rank itself is never
  dead in its own view.
* **Taking back.** :meth:`Membership.take_back` clears returning ranks from
  the dead ledger. Whoever runs the rounds calls it only between rounds (a
  rank taken back mid-round could be handed work by a round that already
  gave its share to others): the runner's ``_admit``
  (``meshkit/train/_coordinator/runner.py``), through ``group.take_back()``. A host
  relay runs no rounds: it takes a reconnecting rank back at once, in its
  own view, and the coordinator keeps that rank returning until its rounds
  take it back.

Every change notifies the membership's condition ``cv``, which its owner
may share (``Membership(rank, cv=...)``): the transport's ledger waits on it
for deaths and joins, a host relay on its own lock.
"""

from __future__ import annotations

import threading
import types
from typing import Iterable, Mapping

__all__ = ["Membership", "describe_dead"]


def describe_dead(dead: Mapping[int, str]) -> str:
    """A dead ledger as an error message quotes it ("rank 2: why; rank 3: why")."""
    return "; ".join(f"rank {r}: {why}" for r, why in sorted(dead.items())) or "none"


class Membership:
    """One view of who is in: joined ranks, the dead ledger, returning ranks, goodbyes.

    ``rank`` is the rank whose view this is (never dead in it). ``cv``, when
    given, is the condition that guards this view and is notified on every
    change (an owner's own, so one lock covers both); else it has its own.
    """

    def __init__(self, rank: int, *, cv: threading.Condition | None = None) -> None:
        self.rank = rank
        self.cv = cv if cv is not None else threading.Condition(threading.RLock())
        self._joined: set[int] = set()
        self._dead: dict[int, str] = {}
        #: Dead ranks that joined again since (a restarted node), until taken back.
        self._returning: set[int] = set()
        #: Dead ranks that said goodbye rather than died.
        self._left: set[int] = set()
        #: The dead ledger, read-only and live (rank -> why): for readers that
        #: already hold ``cv``, or a lone lookup on the per-frame path.
        self.view: Mapping[int, str] = types.MappingProxyType(self._dead)
        #: Bumped (under ``cv``) by every change below: equal numbers, the same
        #: joined and dead ranks, so a reader may keep its copies until it moves.
        self.generation = 0

    # -- reading --------------------------------------------------------------

    def is_dead(self, rank: int) -> bool:
        """Whether ``rank`` is dead, without the lock (one dict lookup; the per-frame path)."""
        return rank in self._dead

    def reason(self, rank: int) -> str | None:
        """Why ``rank`` was declared dead, or None."""
        with self.cv:
            return self._dead.get(rank)

    def dead(self) -> dict[int, str]:
        """The dead ledger: rank -> why it was declared dead (a copy)."""
        with self.cv:
            return dict(self._dead)

    def joined(self) -> list[int]:
        """The ranks that joined (dead or not)."""
        with self.cv:
            return sorted(self._joined)

    def has_joined(self, rank: int) -> bool:
        with self.cv:
            return rank in self._joined

    def live(self, ranks: Iterable[int]) -> list[int]:
        """The given ranks that joined and are not dead, in the given order."""
        with self.cv:
            return [r for r in ranks if r in self._joined and r not in self._dead]

    def returning(self) -> list[int]:
        """Dead ranks that joined again, waiting to be taken back."""
        with self.cv:
            return sorted(self._returning)

    def left(self) -> list[int]:
        """Dead ranks that said goodbye (declared with ``left=True``), not died."""
        with self.cv:
            return sorted(self._left)

    def describe(self) -> str:
        """The dead ledger as an error message quotes it (:func:`describe_dead`)."""
        return describe_dead(self.dead())

    # -- changing: the only code that does ------------------------------------

    def join(self, rank: int) -> bool:
        """``rank``'s handshake completed; True when it is returning (dead, joined again)."""
        with self.cv:
            self._joined.add(rank)
            back = rank in self._dead
            if back:
                self._returning.add(rank)
            self.generation += 1
            self.cv.notify_all()
        return back

    def declare_dead(self, rank: int, reason: str, *, left: bool = False) -> bool:
        """Record ``rank`` as dead for ``reason``; False if it already is, or is this rank.

        ``left``: it said goodbye on purpose (:meth:`left` lists it).
        """
        with self.cv:
            if rank in self._returning:
                # The returning node's new link failed before it was taken back.
                self._returning.discard(rank)
            elif rank in self._dead or rank == self.rank:
                return False
            self._dead[rank] = reason
            if left:
                self._left.add(rank)
            else:
                self._left.discard(rank)
            self.generation += 1
            self.cv.notify_all()
        return True

    def take_back(self, ranks: Iterable[int] | None = None) -> list[int]:
        """Clear returning ranks (all, or those of ``ranks``) from the dead ledger; those cleared.

        Only between rounds (the module docstring says why).
        """
        with self.cv:
            back = sorted(self._returning if ranks is None
                          else self._returning.intersection(ranks))
            for rank in back:
                self._dead.pop(rank, None)
                self._left.discard(rank)
                self._returning.discard(rank)
            if back:
                self.generation += 1
                self.cv.notify_all()
        return back
