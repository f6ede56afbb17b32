"""One rank's TCP links: the :class:`meshkit.transport.Links` contract over sockets.

Rule: this module owns every socket, channel and reader thread of one rank
(see :mod:`meshkit_tcp.tcp` for the whole picture): registering a link,
reading it, sending on it, dropping it, admitting a dialer (rank checks)
and dialing. How a socket is made is :mod:`meshkit_tcp.sockets`; what is
said right after the handshake is :mod:`meshkit_tcp.joining`; rank 0's host
relays are :mod:`meshkit_tcp.relay_hub`.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

from meshkit import wire
from meshkit.errors import ConfigError, MeshError, PeerLostError, WireError
from meshkit.node.config import NodeConfig
from meshkit.transport import (
    META_KEY,
    TAG_BYE,
    TAG_RELAY_CTL,
    TAG_WELCOME,
    LinkEvents,
    Links,
    Message,
    describe_dead,
)

from meshkit_tcp import TcpOptions
from meshkit_tcp.joining import (
    KIND_CONTROL,
    KIND_MODEL,
    KIND_NAMES,
    MAX_REFUSED,
    ROLE_MESH,
    ROLE_NAMES,
    ROLE_REDIAL,
    ROLE_RELAY,
    ROLE_STAR,
    STALE_LINK_WAIT,
    read_welcome,
    send_refusal,
)
from meshkit_tcp.relay_hub import RelayHub, RelayLink
from meshkit_tcp.resuming import ResumingLinks
from meshkit_tcp.sockets import accept_loop, dial, format_address, listen, parse_address

__all__ = ["TcpLinks"]

log = logging.getLogger(__name__)

#: Seconds at most (and at most the stall timeout) a closing coordinator keeps
#: a host relay's connection open for the relay's own goodbye.
_RELAY_GOODBYE_WAIT = 5.0


class TcpLinks(RelayHub, ResumingLinks, Links):
    """One rank's TCP links (see the module docstring): the transport contract over sockets.

    It owns every socket this rank has: the listener, one channel per peer
    (a host relay's one connection shared by the ranks behind it), their
    reader threads, the handshakes in progress and the UDP discovery
    responder. :class:`TcpGroup` wraps it; the kernel reaches it only
    through :class:`meshkit.transport.Links` and reports nothing back but
    through the :class:`meshkit.transport.LinkEvents` it attached. Its own
    state is guarded by its own lock: nothing here touches the kernel's.
    """

    # Every write runs through a channel that honours Message.deadline.
    send_deadlines = True
    # Each link has its own reader thread, which delivers only that link's frames.
    inline_delivery = True

    def __init__(self, config: NodeConfig, options: TcpOptions, *,
                 benchmark_only_disable_mac: bool = False) -> None:
        #: Guards the channels, threads, handshakes and refusals below; notified
        #: when a link comes up, is dropped, or a connection is refused.
        self._lock = threading.Condition()
        #: The kernel's callbacks (set by Group.__init__ through attach).
        self._events: LinkEvents
        #: Where this rank listens, once bound (``group.address``).
        self._bound = ""
        self.config = config
        self.rank = config.rank
        self.world_size = config.world
        self.timeout = float(config.timeout)
        self.is_star = config.is_star
        self.max_frame = int(options.max_frame_bytes)
        if not 0 < self.max_frame < 1 << 63:
            # Checked here: inside every handshake it would refuse each peer instead.
            raise ConfigError(f"[transport] max_frame_bytes must be a positive byte count "
                              f"below 2**63, got {self.max_frame}")
        self.max_message = int(options.max_message_bytes)
        if not 0 < self.max_message < 1 << 63:
            raise ConfigError(f"[transport] max_message_bytes must be a positive byte count "
                              f"below 2**63, got {self.max_message}")
        #: Connections refused or failed at the handshake (newest last, the
        #: last 256), for operators and tests: a bad peer is reported here,
        #: not raised.
        self.refused: list[str] = []
        self._channels: dict[int, wire.Channel] = {}
        self._threads: list[threading.Thread] = []
        self._listener: socket.socket | None = None
        self._accepting = threading.Event()
        self._admitting: set[int] = set()
        self._handshaking: set[socket.socket] = set()
        #: Only used by benchmarks (MAC off on both ends); never from config.
        self._benchmark_only_disable_mac = benchmark_only_disable_mac
        #: Rank 0's UDP discovery responder (or a worker's resolver), closed with the links.
        self.discovery: Any = None
        #: Host relays connected to this coordinator, by name, and the relay
        #: each rank behind one is reached through (all under ``_lock``).
        self._relays: dict[str, RelayLink] = {}
        self._via: dict[int, str] = {}
        #: Body bytes this rank received and sent (benchmarks/scale.py reads them).
        self.bytes_in = 0
        self.bytes_out = 0
        # Several threads send at once (the pool's writers, one per link; relays' and
        # resumed transfers' threads): each adds what it sent under this lock.
        self._count_lock = threading.Lock()
        #: (peer, tag) -> the wire placers the kernel registered for that
        #: peer's frames (receive_into); read by the peer's reader thread.
        self._placers: dict[tuple[int, int], list[Any]] = {}
        self._init_resume()

    @property
    def address(self) -> str:
        return self._bound

    def attach(self, events: LinkEvents) -> None:
        self._events = events

    @property
    def relays(self) -> dict[str, list[int]]:
        """Coordinator: each connected host relay's name -> the ranks that joined through it."""
        with self._lock:
            return {name: sorted(link.joined) for name, link in self._relays.items()}

    @property
    def relay_bytes_in(self) -> dict[str, int]:
        """Coordinator: body bytes each connected host relay sent up, by name (its ranks'
        frames and its own answers); a part of ``bytes_in``."""
        with self._lock:
            return {name: link.bytes_in for name, link in self._relays.items()}

    # -- the links (the kernel calls these) -------------------------------------

    def _channel(self, peer: int) -> wire.Channel:
        # Every send looks its channel up: one dict read is atomic, no lock needed.
        channel = self._channels.get(peer)
        if channel is None:
            why = self._events.dead_reason(peer) or "no connection"
            raise PeerLostError(f"rank {peer} is unreachable: {why}")
        return channel

    def relay_now(self, peer: int, message: Message) -> bool:
        # Forward on the sender's reader thread only when the kernel takes the
        # whole frame at once; otherwise the kernel queues it for a writer thread.
        if message.raw is None:
            return False
        channel = self._channel(peer)
        try:
            return channel.forward_now(message.raw, sender=message.src)
        except PeerLostError as exc:
            self._events.lost(peer, str(exc))
            raise

    def transmit(self, peer: int, message: Message, timeout: float | None) -> None:
        channel = self._channel(peer)
        try:
            if message.raw is not None and message.src != self.rank:
                # A relay forwards the authenticated body unchanged (no re-encoding),
                # naming the original sender in the new header.
                raw, src, deadline = message.raw, message.src, message.deadline
                self._sent(self._send_resuming(peer, channel, lambda c: c.forward(
                    raw, sender=src, deadline=deadline)))
                return
            meta: Any = message.meta
            if message.dst != peer or peer in self._via:
                # A relay's connection carries several ranks: it needs the destination.
                meta = {**meta, "dst": message.dst}
            # No copy of the payload when there is no metadata (an activation).
            state = {**message.payload, META_KEY: dict(meta)} if meta else message.payload
            model = message.kind == "model"
            self._sent(self._send_model(peer, channel, KIND_MODEL if model else KIND_CONTROL,
                                        message.tag, state, message.deadline))
        except PeerLostError as exc:
            self._events.lost(peer, str(exc))
            raise
        except WireError:
            if channel.closed:  # a write failure, not a payload we could not encode
                self._events.lost(peer, "the connection broke while sending")
            raise

    def _sent(self, nbytes: int) -> None:
        """Count ``nbytes`` of body sent (``bytes_out``; from any sending thread)."""
        with self._count_lock:
            self.bytes_out += nbytes

    def drop(self, peer: int) -> None:
        self._forget(peer)
        with self._lock:
            channel = self._channels.pop(peer, None)
            relay = self._via.pop(peer, None)
            link = self._relays.get(relay) if relay is not None else None
            told = link is not None and peer in link.reported
            if link is not None:
                # Restarted, the rank may join through its relay again.
                link.joined.discard(peer)
                link.reported.discard(peer)
            self._lock.notify_all()  # a mesh forming waits for links or deaths
        if relay is not None and channel is not None:
            if told:
                return  # the relay reported this death: it dropped the rank already
            # The relay's connection carries other ranks: tell the relay to drop
            # this one instead of closing it (best effort: a dying relay is
            # noticed by its reader).
            reason = self._events.dead_reason(peer) or "declared dead"
            try:
                channel.send(KIND_CONTROL, TAG_RELAY_CTL,
                             {"op": "dead", "rank": peer, "reason": reason})
            except (MeshError, OSError):
                pass
            return
        if channel is not None:
            channel.close()

    def close(self) -> None:
        self._accepting.clear()
        self._stopping.set()
        if self.discovery is not None:
            self.discovery.close()
        if self._listener is not None:
            try:
                self._listener.close()
            except OSError:
                pass
        with self._lock:
            # One goodbye per connection, a relay's included.
            channels = list({id(c): c for c in self._channels.values()}.values())
            channels += [link.channel for link in self._relays.values()
                         if all(link.channel is not c for c in channels)]
            relays = list(self._relays.values())
            self._channels.clear()
            self._via.clear()
            pending = list(self._handshaking)
        for sock in pending:  # unblock handshakes in progress
            wire.close_socket(sock)

        def goodbye(channel: wire.Channel) -> None:
            try:
                channel.send(KIND_CONTROL, TAG_BYE, {})
            except (MeshError, OSError):
                pass

        # Say goodbye so peers log a leave, not a failure. Best effort and in
        # parallel, bounded: a stalled peer must not make close() wait its
        # whole write timeout (closing the socket below unblocks the send).
        byes = [threading.Thread(target=goodbye, args=(c,), daemon=True) for c in channels]
        for thread in byes:
            thread.start()
        for thread in byes:
            thread.join(0.5)
        # A relay delivers what came before the goodbye to its ranks, then says
        # its own: its connection stays open until then (bounded), so a frame
        # it sends up meanwhile does not find it closed and pass for a lost
        # coordinator.
        deadline = time.monotonic() + min(self.timeout, _RELAY_GOODBYE_WAIT)
        for link in relays:
            link.read_to_end.wait(max(0.0, deadline - time.monotonic()))
        for channel in channels:
            channel.close()
        current = threading.current_thread()
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            if thread is not current:
                thread.join(timeout=max(self.timeout, 1.0) + 1.0)

    def peer_key(self, peer: int) -> bytes | None:
        channel = self._channels.get(peer)
        return None if channel is None else channel.peer_key

    def receive_into(self, peer: int, tag: int, placer: Any) -> Any:
        """Have ``peer``'s frames under ``tag`` offered to ``placer`` (a :class:`meshkit.wire.Placer`).

        A mesh link's reader then receives a body the placer expects
        straight into the placer's buffer (the mesh all-reduce's ring
        segments). Returns a function that unregisters the placer; a star
        offers no frame to a placer (its links carry relayed frames).
        """
        placers = self._placers
        key = (peer, tag)
        with self._lock:
            placers[key] = [*placers.get(key, ()), placer]

        def remove() -> None:
            with self._lock:
                left = [p for p in placers.get(key, ()) if p is not placer]
                if left:
                    placers[key] = left
                else:
                    placers.pop(key, None)

        return remove

    # -- link management ------------------------------------------------------

    def _spawn(self, target: Any, *args: Any, name: str) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            # Forget finished threads: a long-lived coordinator sees many
            # short handshake threads (reconnects, refused peers).
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        try:
            thread.start()
        except BaseException:
            with self._lock:  # close() must not join a thread that never started
                self._threads.remove(thread)
            raise

    def _register(self, rank: int, channel: wire.Channel) -> None:
        with self._lock:
            # The rank's reservation (_rank_problem) ends here, in the same step
            # that puts it in the routing table: released any earlier, a second
            # node claiming it could be welcomed too; any later, a node that
            # joined, left and restarted at once would find its old reservation
            # and be refused as a duplicate of itself.
            self._admitting.discard(rank)
            if self._events.closed:
                channel.close()
                return
            self._channels[rank] = channel
            self._lock.notify_all()
        self._events.linked(rank)
        self._spawn(self._reader, rank, channel, name=f"meshkit-tcp-r{self.rank}-from-{rank}")

    def _reader(self, rank: int, channel: wire.Channel) -> None:
        # The star's coordinator and every mesh link trust the handshake for
        # the sender; a star worker hears only the coordinator, which names the
        # original sender of relayed frames.
        trust_sender = self.is_star and not self.is_coordinator
        events = self._events
        # Only a mesh link carries a frame from its peer to this rank alone.
        place = None if self.is_star else _LinkPlacer(self._placers, rank)
        stopped = self._reading(channel) if self._resume else None
        while True:
            try:
                frame = channel.recv(timeout=None, place=place)
            except (PeerLostError, WireError) as exc:
                if stopped is not None:
                    stopped.set()  # a transfer cut here is parked: a redial may claim it
                if self._resume and not events.closed:
                    # A cut star link: the worker redials, the coordinator waits for it.
                    if self.is_coordinator:
                        if self._held(rank, channel):
                            return  # the redial's reader carries on
                    else:
                        replacement = self._redial(rank, channel, str(exc))
                        if replacement is not None:
                            channel = replacement
                            stopped = self._reading(channel)
                            continue
                if not events.closed:
                    events.lost(rank, str(exc))
                return
            except Exception as exc:  # a decoder bug must still drop the peer, not hang
                log.exception("rank %d: unexpected error reading from rank %d", self.rank, rank)
                events.lost(rank, f"unexpected {type(exc).__name__}: {exc}")
                return
            if frame.tag == TAG_BYE:
                events.lost(rank, "closed its connection (left the mesh)", quiet=True)
                return
            self.bytes_in += frame.nbytes
            state = frame.state
            meta = state.pop(META_KEY, None)
            if meta is None:
                meta = {}
            if not isinstance(meta, dict):
                events.lost(rank, f"sent a malformed {META_KEY!r} entry (protocol violation)")
                return
            src = frame.sender if trust_sender else rank
            if not trust_sender and frame.sender != rank:
                events.lost(rank, (
                    f"sent a frame claiming to come from rank {frame.sender} "
                    f"(protocol violation)"))
                return
            dst = meta.get("dst", self.rank)
            if isinstance(dst, bool) or not isinstance(dst, int) or not 0 <= dst < self.world_size:
                events.lost(rank, f"sent a frame for invalid rank {dst!r}")
                return
            events.deliver(Message(src, dst, frame.tag, state, meta,
                                   KIND_NAMES.get(frame.kind, "control"), raw=frame))
            # Blocked in the next recv, this reader must not keep the frame it
            # delivered alive: one reader per peer would hold a model per peer.
            del frame, state

    def _handshake(self, sock: socket.socket, timeout: float,
                   offers: Any = (), redial: bool = False) -> wire.Channel:
        if self._resume and self.is_coordinator:
            offers = self._offers_for  # known once the dialer's hello is
        return wire.handshake(
            sock, self.config.secret, rank=self.rank, world=self.world_size,
            role=ROLE_REDIAL if redial else ROLE_STAR if self.is_star else ROLE_MESH,
            timeout=self.timeout, handshake_timeout=timeout, max_frame=self.max_frame,
            encrypt=self.config.encrypt, node_key=self.config.node_key,
            segment=self.config.segment_bytes, max_message=self.max_message,
            offers=offers, partials=self.partials,
            benchmark_only_disable_mac=self._benchmark_only_disable_mac)

    # -- accepting side -------------------------------------------------------

    def _listen(self, address: str) -> None:
        self._listener = listen(address, "listen address")
        self._bound = format_address(self._listener.getsockname())
        self._accepting.set()
        self._spawn(self._accept_loop, name=f"meshkit-tcp-accept-r{self.rank}")

    def _accept_loop(self) -> None:
        assert self._listener is not None
        accept_loop(self._listener, self._accepting.is_set, f"rank {self.rank}", self._admit,
                    self._refuse, spawn=lambda target: self._spawn(
                        target, name=f"meshkit-tcp-admit-r{self.rank}"))

    def _refuse(self, where: str, message: str) -> None:
        log.warning("rank %d refused %s: %s", self.rank, where, message)
        with self._lock:
            self.refused.append(f"{where}: {message}")
            # Anyone may connect and hang up: keep the newest, not every one.
            del self.refused[:-MAX_REFUSED]
            self._lock.notify_all()

    def _admit(self, sock: socket.socket, where: str) -> None:
        sock.settimeout(self.timeout)
        with self._lock:
            if self._events.closed:
                sock.close()
                return
            self._handshaking.add(sock)
        try:
            channel = self._handshake(sock, self.timeout)
        except (MeshError, OSError) as exc:
            if not self._events.closed:
                self._refuse(where, str(exc))
            return
        finally:
            with self._lock:
                self._handshaking.discard(sock)
        rank = channel.peer.rank
        if channel.peer.role == ROLE_RELAY:
            self._admit_relay(channel, where)
            return
        problem = self._identity_problem(channel)
        replacing = False
        if problem is None and channel.peer.role == ROLE_REDIAL:
            replacing = self._replaceable(channel)
            if not replacing:
                problem = self._redial_problem(rank)
        elif problem is None and self._resume:
            self._restarted(channel)  # a new node claiming a held rank ends the hold
        if problem is None and not replacing:
            problem = self._rank_problem(rank, channel.peer.role)
        if problem is not None:
            send_refusal(channel, problem)
            self._refuse(f"{where} (rank {rank})", problem)
            return
        try:
            channel.send(KIND_CONTROL, TAG_WELCOME, {
                "ok": True, "topology": "star" if self.is_star else "mesh"})
        except (MeshError, OSError) as exc:
            channel.close()
            with self._lock:
                self._admitting.discard(rank)
            self._refuse(f"{where} (rank {rank})", str(exc))
            return
        if replacing:
            # A live rank's redial: its new link takes the old one's place, no death.
            if self._swap(rank, channel) is not None:
                log.info("rank %d: rank %d redialed; its link is replaced", self.rank, rank)
                self._spawn(self._reader, rank, channel,
                            name=f"meshkit-tcp-r{self.rank}-from-{rank}")
                self._resend_kept(rank, channel)
            return
        self._register(rank, channel)  # which ends the rank's reservation

    def _identity_problem(self, channel: wire.Channel) -> str | None:
        """Why the node key ``channel``'s peer proved (or did not) may not join, or None."""
        authorized = self.config.authorized_nodes
        if authorized is None:
            return None
        return authorized.problem(channel.peer_key, channel.peer.rank)

    def has_link(self, rank: int) -> bool:
        """Whether ``rank`` is connected (or being admitted) now: discovery's rejoin test."""
        with self._lock:
            return rank in self._channels or rank in self._admitting

    def _rank_problem(self, rank: int, role: int) -> str | None:
        """Why a handshaken peer claiming ``rank`` may not join, or None."""
        mine = "star" if self.is_star else "mesh"
        theirs = ROLE_NAMES.get(role, f"unknown ({role})")
        if theirs != mine:
            return (f"rank {rank} runs a {theirs} topology, rank {self.rank} a {mine}; give "
                    f"every node the same peers form (one coordinator address for a star, "
                    f"world addresses for a mesh)")
        dead = self._events.dead_reason(rank)
        with self._lock:
            if rank == self.rank:
                return (f"rank {rank} is this node's own rank; give the dialing node a "
                        f"different rank")
            if not self.is_coordinator and self.is_star:
                return "a star worker accepts no connections"
            if not self.is_star and rank < self.rank:
                return (f"in a mesh rank {self.rank} dials rank {rank}, not the other way "
                        f"round; check that every node has the same peers list")
            if dead is not None and not (self.is_coordinator and self.is_star):
                return (f"rank {rank} was declared dead ({dead}); a dead rank "
                        f"cannot rejoin a mesh")
            if dead is not None and rank in self._channels:
                # Declared dead, its old link not dropped yet (the ledger marks
                # a death before the group drops the link): wait for that drop,
                # bounded, rather than refuse the restarted node as a duplicate.
                self._lock.wait_for(lambda: rank not in self._channels, STALE_LINK_WAIT)
            if rank in self._channels or rank in self._admitting:
                return (f"rank {rank} is already connected to rank {self.rank} (duplicate "
                        f"rank): give each node a distinct rank in 1..{self.world_size - 1}")
            carried = [n for n, link in self._relays.items() if rank in link.ranks]
            if carried:
                return (f"rank {rank} is carried by host relay {carried[0]!r}: start it with "
                        f"--peers naming that relay's address, not the coordinator's")
            # Reserve the rank until the welcome is sent, so two connections
            # claiming it at once cannot both get in.
            self._admitting.add(rank)
        return None

    # -- dialing side ---------------------------------------------------------

    def _dial(self, rank: int, address: str, deadline: float) -> None:
        self._register(rank, self._connect(rank, address, deadline))

    def _connect(self, rank: int, address: str, deadline: float,
                 offers: Any = (), redial: bool = False) -> wire.Channel:
        """Dial ``rank`` at ``address``: handshake, then its welcome; the channel."""
        host, port = parse_address(address, what=f"rank {rank}'s address")
        sock = dial(host, port, deadline, self.timeout, lambda exc: PeerLostError(
            f"rank {self.rank} could not reach rank {rank} at {address} within "
            f"{self.timeout:g} s; is it running and listening there?"),
            closed=lambda: self._events.closed)
        channel = self._handshake(sock, max(0.001, deadline - time.monotonic()), offers,
                                  redial)
        if channel.peer.rank != rank:
            channel.close()
            raise WireError(
                f"the node at {address} is rank {channel.peer.rank}, expected rank {rank}; "
                f"check the peers list (index = rank)")
        read_welcome(channel, rank, address, deadline, me=self.rank,
                     topology="star" if self.is_star else "mesh")
        return channel

    def _redial(self, rank: int, lost: wire.Channel, reason: str) -> wire.Channel | None:
        """Star worker: dial the coordinator again after a cut; the new channel, or None.

        Offers the transfers kept for it; tries until ``resume_seconds`` pass
        (a refusal ends it at once). The new channel takes the lost one's place.
        """
        address = self.config.peers[0]
        deadline = time.monotonic() + self.resume_seconds
        log.warning("rank %d: lost rank %d (%s); redialing for %g s", self.rank, rank, reason,
                    self.resume_seconds)
        while self._redial_pause(deadline):
            with self._lock:
                offers = [k.transfer for k in self._kept.get(rank, ())
                          if k.transfer.offerable()]
            try:
                channel = self._connect(rank, address, deadline, offers[-wire.MAX_OFFERS:],
                                        redial=True)
            except PeerLostError as exc:
                log.info("rank %d: redial of rank %d failed: %s", self.rank, rank, exc)
                continue
            except (MeshError, OSError) as exc:  # refused, or not the node it was
                log.warning("rank %d: redial of rank %d refused: %s", self.rank, rank, exc)
                return None
            with self._lock:
                if self._events.closed:
                    channel.close()
                    return None
                self._channels[rank] = channel
                self.redials += 1
                self._lock.notify_all()
            log.info("rank %d: redialed rank %d", self.rank, rank)
            self._resend_kept(rank, channel)
            return channel
        return None

    # -- bring-up ---------------------------------------------------------------

    def start(self) -> None:
        """Bring this rank's links up: listen and/or dial, as its topology says."""
        if self.is_star:
            self._start_star()
        else:
            self._start_mesh()

    def _start_star(self) -> None:
        cfg = self.config
        if self.is_coordinator:
            address = cfg.bind or (cfg.peers[0] if cfg.peers else None)
            if address is None:
                raise ConfigError(
                    "the coordinator needs an address to listen on: set bind (e.g. "
                    "127.0.0.1:0) or peers = [its own host:port]")
            self._listen(address)
            return
        if not cfg.peers:
            raise ConfigError("a star worker needs the coordinator's address: peers = [host:port]")
        self._dial(0, cfg.peers[0], time.monotonic() + self.timeout)

    def _start_mesh(self) -> None:
        cfg = self.config
        if len(cfg.peers) != self.world_size:
            raise ConfigError(
                f"a mesh needs {self.world_size} peer addresses (one per rank), got "
                f"{len(cfg.peers)}")
        listen_at = cfg.peers[self.rank]
        if self.rank == 0 and cfg.bind:
            listen_at = cfg.bind
        deadline = time.monotonic() + self.timeout
        if self.rank < self.world_size - 1:
            self._listen(listen_at)
        else:
            self._bound = listen_at
        for rank in range(self.rank):
            self._dial(rank, cfg.peers[rank], deadline)
        expected = set(range(self.world_size)) - {self.rank}

        def dead() -> dict[int, str]:
            reasons = {r: self._events.dead_reason(r) for r in expected}
            return {r: why for r, why in reasons.items() if why is not None}

        with self._lock:
            # _register and drop notify: a link came up, or a peer died.
            if not self._lock.wait_for(lambda: expected <= set(self._channels) | set(dead()),
                                       max(0.0, deadline - time.monotonic())):
                missing = sorted(expected - set(self._channels))
                raise PeerLostError(
                    f"rank {self.rank}: rank(s) {missing} did not connect within "
                    f"{self.timeout:g} s; start every rank with the same peers list")
        lost = dead()
        if lost:
            raise PeerLostError(f"rank {self.rank}: lost a peer while forming the mesh: "
                                f"{describe_dead(lost)}")
        # Every pair is connected: nobody else may join a mesh.
        self._accepting.clear()


class _LinkPlacer:
    """A mesh link's :class:`meshkit.wire.Placer`: the first placer registered for the frame's tag that wants it."""

    def __init__(self, placers: dict[tuple[int, int], list[Any]], peer: int) -> None:
        self._placers = placers
        self._peer = peer
        self._chosen: Any = None

    def head_size(self, tag: int, flags: int, nbytes: int) -> int:
        self._chosen = None
        for placer in tuple(self._placers.get((self._peer, tag), ())):
            size = placer.head_size(tag, flags, nbytes)
            if size:
                self._chosen = placer
                return size
        return 0

    def place(self, head: bytes) -> Any:
        chosen, self._chosen = self._chosen, None
        return None if chosen is None else chosen.place(head)
