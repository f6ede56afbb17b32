"""The Group: one rank's handle on the mesh, built on a transport's :class:`Links`.

Everything above a direct link is decided here, once for every transport:
which rank a message goes to first (routing; a star's workers reach each
other through the coordinator), what a received message is (for this rank's
mailboxes, to relay, or a frame on a retired or handshake-only tag to drop),
and what declaring a rank dead does (the membership records it, its relay
queue is freed, the transport drops its link, ``on_dead`` hears of it). The
pieces live in their own modules: who is in (``_membership.py``), routing
over it (``_ledger.py``), the mailboxes (``_mailbox.py``), the star's
forwarding (``_forwarding.py``) and the mesh all-reduce (``_collective.py``).

A hot path that cannot afford a thread hand-off per message (a pipeline
stage) diverts its (source, tag) to a handler (:meth:`Group.divert`), which
then runs on the thread that delivered the message; :attr:`Group.inline_delivery`
says whether that is the transport's reader of that one link (so the handler
may do real work there) or some other thread it must not hold up.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

from meshkit.errors import MeshError
from meshkit.transport._collective import Collective
from meshkit.transport._contract import LinkEvents, Links
from meshkit.transport._ledger import Ledger
from meshkit.transport._mailbox import MAX_UNREAD_BYTES, Handler, Mailboxes
from meshkit.transport._message import Message, check_state
from meshkit.transport._forwarding import StarForwarder
from meshkit.transport._timeouts import deadline_after, shown
from meshkit.transport.tags import RETIRED_TAGS, TAG_WELCOME, check_tag

__all__ = ["ANY", "Group"]

log = logging.getLogger(__name__)

#: ``recv(ANY, tag)`` on the coordinator takes the next frame from any rank.
ANY = None

#: Tags a delivered message is dropped on: the handshake's, and the retired ones.
_DROPPED = frozenset({TAG_WELCOME, *RETIRED_TAGS})


class Group:
    """One rank's handle on the mesh (the Group API; the package docstring has it all).

    Built by a transport's ``connect()`` around its :class:`Links`. A
    transport may subclass it to add attributes of its own (``tcp`` adds
    ``refused``); the group's underscore attributes are not part of the
    contract.
    """

    def __init__(self, links: Links, *, rank: int, world_size: int, timeout: float,
                 is_star: bool, max_unread: int = MAX_UNREAD_BYTES) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = float(timeout)
        self.is_star = bool(is_star)
        #: Called with (rank, reason) after a rank is declared dead (observers).
        self.on_dead: Callable[[int, str], None] | None = None
        self._links = links
        self._ledger = Ledger(rank, world_size, is_star=self.is_star)
        self._mailboxes = Mailboxes(self._ledger, self.timeout, max_unread=max_unread,
                                    on_breach=self.declare_dead)
        self._forwarder = StarForwarder(self._ledger, links, self.declare_dead, self.timeout)
        self._collective = Collective(self._ledger, self._mailboxes, self._send_message, links,
                                      self.timeout, self.is_star)
        links.attach(_Events(self))

    # -- properties -----------------------------------------------------------

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    @property
    def address(self) -> str:
        """Where this rank can be reached (the transport's :attr:`Links.address`)."""
        return self._links.address

    @property
    def dead(self) -> dict[int, str]:
        """The dead ledger: rank -> why it was declared dead (a copy)."""
        return self._ledger.dead()

    @property
    def joined(self) -> list[int]:
        return self._ledger.joined()

    @property
    def generation(self) -> int:
        """How many times :attr:`joined` or :attr:`dead` changed: while it reads the
        same, so do they (read it *before* copying them, and a reader may keep its
        copies until it moves). Lock-free: one attribute read."""
        return self._ledger.members.generation

    @property
    def live_ranks(self) -> list[int]:
        return self._ledger.live_ranks()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (every wait then ends in ``PeerLostError``)."""
        return self._ledger.closed

    @property
    def inline_delivery(self) -> bool:
        """Whether a diverted handler runs on the transport's reader of the sender's link.

        True (the transport's :attr:`Links.inline_delivery`): the handler
        may compute and send there, holding up only that link. False: it
        runs on a thread it must not hold up (``inproc`` delivers on the
        sender's thread), so it should only queue the payload.
        """
        return bool(self._links.inline_delivery)

    @property
    def relays(self) -> dict[str, list[int]]:
        """A star's coordinator: each host relay's name -> the live ranks that joined through it
        (the transport's :attr:`Links.relays` minus the dead ledger; ``{}`` without relays)."""
        dead = self._ledger.dead()
        return {name: sorted(r for r in ranks if r not in dead)
                for name, ranks in self._links.relays.items()}

    def peer_key(self, rank: int) -> bytes | None:
        """The node key ``rank`` proved on its direct link (None: no key, or no direct link)."""
        return self._links.peer_key(rank)

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} rank {self.rank}/{self.world_size} "
                f"{'star' if self.is_star else 'mesh'} {self.address}>")

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the Group API --------------------------------------------------------

    def send(self, dst: int, tag: int, payload: Mapping[str, Any], *,
             deadline: float | None = None) -> None:
        """Send ``payload`` to rank ``dst`` under ``tag`` (see the package docstring).

        ``deadline`` (``time.monotonic()`` seconds) bounds the whole write on
        transports that honour it (:attr:`Links.send_deadlines`): a next hop
        still not taking it by then is dropped, a ``PeerLostError``.
        """
        self._check_rank(dst, "dst")
        if dst == self.rank:
            raise ValueError(f"rank {self.rank} cannot send to itself")
        check_tag(tag)
        check_state(payload)
        self._send_message(Message(self.rank, dst, tag, payload, deadline=deadline))

    def recv(self, src: int | None, tag: int, timeout: float | None = None) -> Any:
        """Receive the next payload with ``tag`` from ``src`` (``ANY``: ``(src, state)``)."""
        if src is not None:
            self._check_rank(src, "src")
        elif not self.is_coordinator:
            raise ValueError("recv(ANY, tag) is only available on the coordinator (rank 0)")
        check_tag(tag, service=True)
        message = self._mailboxes.take(tag, None if src is None else {src}, timeout)
        if src is None:
            return message.src, message.payload
        return message.payload

    def divert(self, src: int, tag: int, handler: Handler) -> list[Mapping[str, Any]]:
        """Hand each later message with ``tag`` from ``src`` to ``handler(payload)``.

        The handler runs on the thread that delivered the message (see
        :attr:`inline_delivery`), in arrival order, instead of the message
        waiting for a ``recv``; it returns True when it took the payload, or
        False to have it queued for ``recv`` as usual (and must then decline
        every later one too, so order holds). Returns the payloads of such
        messages queued before this call, oldest first: serve them before
        anything the handler gets. :meth:`undivert` ends it.
        """
        self._check_rank(src, "src")
        check_tag(tag)
        return self._mailboxes.divert(src, tag, handler)

    def undivert(self, src: int, tag: int, handler: Handler) -> None:
        """Stop diverting ``tag`` from ``src`` to ``handler``: ``recv`` gets them again."""
        self._mailboxes.undivert(src, tag, handler)

    def wait_for_workers(self, timeout: float | None = None) -> list[int]:
        """Coordinator: block until every worker has joined (or is dead)."""
        if not self.is_coordinator:
            raise MeshError("wait_for_workers() is for the coordinator (rank 0)")
        deadline = deadline_after(timeout, self.timeout)
        return self._ledger.wait_for_workers(deadline, shown(timeout, self.timeout))

    def mesh_all_reduce(self, state: Mapping[str, Any], weight: float = 1.0, *,
                        ranks: Any = None, timeout: float | None = None) -> dict[str, Any]:
        """Every rank in ``ranks`` (default: all): the weighted mean of their states, no fold on rank 0.

        The transport's own collective when it has one, else a ring over the
        direct links (``_collective.py`` documents the rule); a star without
        one is refused.
        """
        return self._collective.all_reduce(state, weight, ranks, timeout)

    def mesh_sum(self, arrays: Mapping[str, Any], *, ranks: Any, step: int,
                 op: str = "sum", timeout: float | None = None) -> dict[str, Any]:
        """Every rank in ``ranks``: the exact elementwise sum (``op = "max"``: largest) of
        their ``arrays`` in the arrays' one dtype, over the ring; ``step`` numbers the
        call alike on every participant (``_collective.py``, ``Collective.exact_sum``).
        """
        return self._collective.exact_sum(arrays, ranks, step, timeout, op)

    def declare_dead(self, rank: int, reason: str, *, quiet: bool = False) -> None:
        """Have the membership record ``rank`` as dead (``_membership.py``) and drop its link.

        ``quiet``: a rank that left on purpose (a goodbye, not a death); logged
        at INFO instead of WARNING.
        """
        if not self._ledger.record_death(rank, reason, left=quiet):
            return
        # Relays queued for it cannot be delivered either; readers waiting for
        # room in its queue move on.
        self._forwarder.forget(rank)
        if not self._ledger.closed:
            log.log(logging.INFO if quiet else logging.WARNING,
                    "rank %d: declaring rank %d dead: %s", self.rank, rank, reason)
        try:
            self._links.drop(rank)
        except Exception:  # dropping a dead link is best effort
            log.debug("dropping link to rank %d failed", rank, exc_info=True)
        callback = self.on_dead
        if callback is not None:
            callback(rank, reason)

    @property
    def returning(self) -> list[int]:
        """Coordinator: dead ranks whose node connected again (a restart), not taken back yet."""
        return self._ledger.returning()

    def take_back(self) -> list[int]:
        """Coordinator: clear the returning ranks from the dead ledger; returns them.

        Only between rounds (see :meth:`Ledger.take_back`); a transport that
        never lets a dead rank connect again has none to take back.
        """
        return self._ledger.take_back()

    def close(self) -> None:
        """Leave the mesh; peers see this rank's links as lost. Idempotent."""
        if not self._ledger.close():
            return
        self._forwarder.close()
        self._links.close()

    # -- inside ---------------------------------------------------------------

    def _check_rank(self, rank: Any, what: str) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"{what} must be a rank in 0..{self.world_size - 1}, got {rank!r}")
        return rank

    def _send_message(self, message: Message, timeout: float | None = None) -> None:
        """Route a kernel message (reserved tags allowed) to its next hop."""
        self._links.transmit(self._ledger.next_hop(message.dst), message, timeout)

    def _deliver(self, message: Message) -> None:
        """A complete, authenticated message arrived: relay it or queue it."""
        # A handshake tag after the handshake, or a retired tag (the star reduce
        # service's, removed in issue 21): nobody reads them, so nobody queues them.
        if message.tag in _DROPPED:
            log.warning("rank %d dropped a frame on tag 0x%X from rank %d to rank %d: "
                        "that tag carries no message after the handshake",
                        self.rank, message.tag, message.src, message.dst)
            return
        if message.dst != self.rank:
            self._forwarder.relay(message)
            return
        self._mailboxes.put(message)

    def _linked(self, peer: int) -> None:
        self._mailboxes.forgive(peer)  # a restarted node is not its predecessor's breach
        for message in self._ledger.link(peer):
            self._forwarder.relay(message)


class _Events(LinkEvents):
    """The callbacks a group gives its transport (:meth:`Links.attach`)."""

    def __init__(self, group: Group) -> None:
        self._group = group
        # Every received frame comes through here: the bound method itself,
        # not a method calling it.
        self.deliver = group._deliver  # type: ignore[method-assign]

    def deliver(self, message: Message) -> None:
        self._group._deliver(message)

    def linked(self, peer: int) -> None:
        self._group._linked(peer)

    def lost(self, peer: int, reason: str, *, quiet: bool = False) -> None:
        self._group.declare_dead(peer, reason, quiet=quiet)

    def dead_reason(self, peer: int) -> str | None:
        return self._group._ledger.reason(peer)

    @property
    def closed(self) -> bool:
        return self._group._ledger.closed
