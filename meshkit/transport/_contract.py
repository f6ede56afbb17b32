"""The transport contract: what a transport implements, and the callbacks the kernel gives it.

A transport moves bytes between ranks over *direct links* and nothing more.
It implements :class:`Links`; :class:`meshkit.transport.Group` wraps one and
does everything above a direct link — routing (a star's coordinator relays
worker-to-worker messages), mailboxes, timeouts, the dead ledger and the
reduce service. The transport reports what happens on its links through the
:class:`LinkEvents` the group hands to :meth:`Links.attach`. Neither side
touches the other's locks or underscore attributes.

A transport's ``connect(node_config)`` therefore reads::

    links = MyLinks(node_config)
    group = Group(links, rank=node_config.rank, world_size=node_config.world,
                  timeout=node_config.timeout, is_star=node_config.is_star)
    ...                       # your own dial / accept: events.linked(peer) per link
    return group

Threads: the kernel calls :meth:`Links.transmit`, :meth:`Links.relay_now`
and :meth:`Links.drop` from any thread, concurrently for different peers
(and for the same peer from different threads), and concurrently with the
transport's own receive path; a transport serialises writes to one link
itself. Every :class:`LinkEvents` method may be called from any thread.
"""

from __future__ import annotations

import abc
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

from meshkit.transport._message import Message

__all__ = ["Links", "LinkEvents", "HostRelay", "OffersHostRelays"]


class LinkEvents(abc.ABC):
    """What the kernel offers a transport: report an arrival, a link up, a link lost.

    The group implements it and passes it to :meth:`Links.attach`; a
    transport calls it from its receive path and its link management.
    """

    @abc.abstractmethod
    def deliver(self, message: Message) -> None:
        """A complete, authenticated message arrived over the link from ``message.src``.

        Call it in the order messages arrived on a link, and only for a
        message whose every byte was received and checked: the kernel folds
        reduce contributions as they are delivered, so a half-read one must
        never be. The kernel queues the message for ``recv``, relays it
        (``message.dst`` is another rank and this is a star's coordinator),
        or drops a reduce-service frame this peer may not send. It may wait
        while the relay queue for ``message.dst`` is full (at most half the
        stall timeout): only the calling receive path waits.

        Raises:
            Nothing.
        """

    @abc.abstractmethod
    def linked(self, peer: int) -> None:
        """A direct link to ``peer`` is up (its handshake completed).

        The kernel may transmit to ``peer`` from now on. On the coordinator
        (rank 0) ``peer`` has joined the mesh: messages held for it are
        relayed, and it is expected in the next reduce round.

        Raises:
            Nothing.
        """

    @abc.abstractmethod
    def lost(self, peer: int, reason: str, *, quiet: bool = False) -> None:
        """The link to ``peer`` died; ``reason`` says how, for the dead ledger.

        Report an end of stream, a stalled or broken read or write, a frame
        that failed authentication, or a protocol violation. ``peer`` is
        declared dead for the rest of the group's life and :meth:`Links.drop`
        is called for it. ``quiet=True`` for a peer that left on purpose
        (logged at INFO, not WARNING). Reporting a dead peer again, or
        anything after the group closed, changes nothing.

        Raises:
            Nothing.
        """

    @abc.abstractmethod
    def dead_reason(self, peer: int) -> str | None:
        """Why ``peer`` was declared dead, or None while it is not.

        A transport refuses a dead rank that tries to join again: a rank
        that missed a round no longer holds the model the others hold.

        Raises:
            Nothing.
        """

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """Whether the group was closed: a link lost from now on is no news.

        Raises:
            Nothing.
        """


class Links(abc.ABC):
    """This rank's direct links to its peers: the part of a transport that moves bytes.

    Implement :meth:`attach`, :meth:`transmit` and :meth:`drop`; override
    :meth:`relay_now`, :meth:`all_reduce_sum`, :meth:`close`, :attr:`address`
    and :attr:`send_deadlines` when the defaults do not fit. Ranks are ints in
    ``0 .. world_size - 1``; rank 0 is the coordinator.
    """

    #: Whether :meth:`transmit` honours ``Message.deadline``: fails the write
    #: with ``PeerLostError`` (and reports the link lost) once it passes. A
    #: sender with a deadline (a pipeline stage's activations) relies on it
    #: only where it is True; with False the write is bounded by the
    #: transport's own stall timeout alone.
    send_deadlines: bool = False

    #: Whether :meth:`LinkEvents.deliver` runs on a thread that reads this
    #: link alone (a reader thread per link), so the kernel may let a
    #: diverted handler (``Group.divert``) compute and send on it: it holds
    #: up only the link it read from. Leave False when delivery runs on some
    #: other thread (``inproc`` delivers on the sender's).
    inline_delivery: bool = False

    @property
    def address(self) -> str:
        """Where this rank can be reached (``host:port`` once bound, ``inproc://name``).

        ``group.address`` reads it; ``""`` until it is known.

        Raises:
            Nothing.
        """
        return ""

    @abc.abstractmethod
    def attach(self, events: LinkEvents) -> None:
        """Keep the kernel's callbacks; the group calls it once, before any other method.

        Call ``events`` from the receive path and the link management from
        now on (``Group(links, ...)`` returns after this).

        Raises:
            Nothing.
        """

    @abc.abstractmethod
    def transmit(self, peer: int, message: Message, timeout: float | None) -> None:
        """Write ``message`` whole over the direct link to ``peer``, then return.

        ``peer`` is the next hop and may differ from ``message.dst`` (a star
        worker sends everything to rank 0, which relays it); carry ``src``,
        ``dst``, ``tag``, ``meta``, ``kind`` and ``payload`` so that the
        other side delivers an equal :class:`Message`. The payload must be
        copied onto the link before returning: the caller may reuse its
        arrays. ``message.raw``, when set, is the frame this rank received
        (a relay may forward it unchanged). ``timeout`` bounds a stalled
        write in seconds (None: the transport's own stall timeout).

        Raises:
            PeerLostError: there is no link to ``peer``, or it broke or
                stalled while writing; report a link that broke with
                :meth:`LinkEvents.lost` before raising.
            WireError: the payload cannot be encoded; nothing was sent and
                the link is intact.
        """

    @abc.abstractmethod
    def drop(self, peer: int) -> None:
        """Close the direct link to ``peer``: the kernel declared it dead.

        Idempotent; a peer without a link is no error. A write to ``peer``
        in progress on another thread must end (closing its socket does).

        Raises:
            Nothing that matters: the kernel logs an exception and carries on.
        """

    def relay_now(self, peer: int, message: Message) -> bool:
        """Star coordinator: write a relayed ``message`` to ``peer`` at once, if that cannot wait.

        Called on the thread that received ``message``, which must not wait
        for a destination that stopped reading. Return True once sent, or
        False, having sent nothing, to have it queued for ``peer``'s relay
        writer thread. The default always queues.

        Raises:
            PeerLostError: the write failed (the kernel logs it and drops
                the message).
            WireError: likewise.
        """
        return False

    @property
    def relays(self) -> Mapping[str, Sequence[int]]:
        """Optional, a star's coordinator: its host relays, name -> the ranks joined through each.

        A host relay is one connection carrying several ranks of a host
        (``meshkit relay``). A transport that offers relays routes a
        message for a rank behind one over that connection, delivers what
        comes up it with the rank as ``src``, reports each rank joining
        (:meth:`LinkEvents.linked`) and leaving (:meth:`LinkEvents.lost`),
        and lists them here; ``group.relays`` (minus dead ranks) is what
        the round engine reads to send each relay one request per round
        (``TAG_RELAY``, to any rank it carries). The relay's side of that
        protocol is the kernel's (``meshkit.train.RelayPool``,
        ``meshkit.train.answer_relay_request``): the transport's relay only
        carries bytes between it and its ranks. The default: no relays.

        Raises:
            Nothing.
        """
        return {}

    def peer_key(self, peer: int) -> bytes | None:
        """The node key (32 raw Ed25519 bytes) ``peer`` proved on its link, or None.

        The coordinator uses it to trust the placement tags bound to that key
        (``authorized_nodes``). The default: this transport proves no keys.

        Raises:
            Nothing.
        """
        return None

    def receive_into(self, peer: int, tag: int, placer: Any) -> Any:
        """Optional: offer ``peer``'s frames under ``tag`` to ``placer`` (a ``meshkit.wire.Placer``).

        A transport whose links read wire frames can then receive a body the
        placer expects straight into the placer's buffer (the mesh
        all-reduce's ring segments land in place this way). Return a
        function that unregisters the placer, or None (the default), having
        registered nothing: frames then arrive as usual and the ring copies.

        Raises:
            Nothing.
        """
        return None

    def all_reduce_sum(self, buffers: Any, ranks: list[int], check: int,
                       timeout: float) -> bool:
        """Optional: sum ``buffers`` in place over ``ranks`` with the transport's own collective.

        ``buffers`` are flat float32/float64 numpy arrays, the same sizes on
        every participant; ``check`` is an int that must be equal on every
        participant (a digest of the layout): raise ``AggregationError`` on a
        rank whose ``check`` differs. Return True once every buffer holds the
        sum over ``ranks``, or False, having done nothing, to have the group
        run its own ring over the direct links (the default).

        Raises:
            PeerLostError: a participant was lost or stalled past ``timeout``
                seconds; the collective failed on every participant.
            AggregationError: the participants' ``check`` values differ.
        """
        return False

    def close(self) -> None:
        """Release the transport's resources (sockets, threads): the group was closed.

        Called once, by ``group.close()``, after the group stopped taking
        messages. Peers must then see this rank's links as lost.

        Raises:
            Nothing.
        """


class HostRelay(Protocol):
    """A running host relay (``meshkit relay``), as a transport's ``start_relay`` returns it.

    ``address`` is where its ranks dial it (bound before it announced
    them); ``serve()`` blocks until the coordinator ends the run (or is
    lost) and returns its report (``to_json()``; ``stopped`` says why it
    ended: a reason starting ``"coordinator lost"`` exits 2);
    ``close(reason)`` ends it.
    """

    name: str
    ranks: frozenset[int]

    @property
    def address(self) -> str: ...

    def serve(self, timeout: float | None = None) -> Any: ...

    def close(self, reason: str = "closed") -> None: ...


@runtime_checkable
class OffersHostRelays(Protocol):
    """A transport factory that offers host relays: ``meshkit relay`` calls ``start_relay``.

    ``settings`` are ``coordinator``, ``bind``, ``world``, ``ranks``,
    ``secret``, ``name``, ``timeout``, ``encrypt``, ``node_key`` and
    ``authorized_nodes`` (what the command is given). The relay carries
    bytes between its ranks and the coordinator, and serves the
    coordinator's requests to it with the kernel's relay side
    (``meshkit.train.RelayPool``, ``meshkit.train.answer_relay_request``);
    its group on the coordinator lists it in :attr:`Links.relays`.
    """

    def start_relay(self, **settings: Any) -> HostRelay: ...
