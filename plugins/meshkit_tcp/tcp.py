"""The ``tcp`` transport: a star or a full mesh of authenticated TCP channels.

Star (``peers`` = one address, or ``topology = "star"``): the coordinator
(rank 0) listens at ``NodeConfig.bind`` (or the peer address); workers dial
it and nothing dials them, which is what a phone behind NAT can do. A
worker-to-worker ``send`` is relayed by the coordinator, which forwards the
authenticated body unchanged.

Mesh (``peers`` = ``world`` addresses): rank ``i`` listens at ``peers[i]``,
dials every lower rank and accepts every higher one, so every pair has one
connection. ``connect`` returns once all ``world - 1`` links are up.

Every connection runs :func:`meshkit.wire.handshake` (secret-derived keys,
protocol version, world size), then the accepting side checks the claimed
rank (range, expected, not a duplicate of a live rank; in a mesh, not
declared dead: a star's coordinator lets a dead rank's restarted node in,
and the ledger keeps it *returning* until the rounds take it back)
and answers with a welcome frame or a refusal the dialer raises as a
:class:`~meshkit.WireError` naming what differed. A refused or failed
connection never takes the accept loop down: it is logged and counted in
``group.refused``, and the ranks that behave carry on.

Each link has one reader thread that waits for a frame to start without a
timeout (a worker may train for a long time between frames) and then reads
it under the channel's stall timeout: a peer that stops mid-frame, sends
garbage, or fails authentication is dropped and declared dead. A reader
hands the channel the placers registered for its peer
(:meth:`TcpLinks.receive_into`: the mesh all-reduce's ring), so an expected
segment's body lands straight in the ring's buffer.

Host relays (``meshkit relay``, :mod:`meshkit_tcp.relay`): a star's
coordinator also accepts a relay's connection (handshake role ``relay``),
which announces the ranks it carries. Each carried rank that joins the
relay joins the coordinator over that one connection (``group.relays``
lists them); frames to it carry their destination, deaths the coordinator
declares are forwarded to the relay, and a relay connection that is lost
takes exactly its ranks with it.

How it composes (docs/transports.md, "Writing a transport"):
:class:`TcpLinks` implements :class:`meshkit.transport.Links` and owns every
socket, channel and thread above; :class:`TcpGroup` is a plain
:class:`meshkit.transport.Group` wrapped around it that only shows the links'
counters (``refused``, ``bytes_in``, ...), as ``inproc`` wraps
``InprocLinks``.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from typing import Any, Callable

import attrs

from meshkit import wire
from meshkit.errors import ConfigError, MeshError, PeerLostError, WireError
from meshkit.node.config import NodeConfig
from meshkit.transport import (
    META_KEY,
    TAG_BYE,
    TAG_RELAY_CTL,
    TAG_REPLY,
    TAG_WELCOME,
    Group,
    HostRelay,
    LinkEvents,
    Links,
    Message,
    describe_dead,
)
from meshkit.transport.discovery import DiscoveryServer, resolve
from meshkit_tcp import TcpOptions

__all__ = ["TcpTransport", "TcpLinks", "TcpGroup", "parse_address", "MAX_HANDSHAKES"]

log = logging.getLogger(__name__)

#: Frame kind bytes (informative: the tag routes, the kind says how it travelled).
KIND_CONTROL = 1
KIND_MODEL = 2
_KIND_NAMES = {KIND_CONTROL: "control", KIND_MODEL: "model"}
#: How long a restarted rank's admission waits for its dead predecessor's
#: link to be dropped (seconds).
_STALE_LINK_WAIT = 10.0
#: Seconds at most (and at most the stall timeout) a closing coordinator keeps
#: a host relay's connection open for the relay's own goodbye.
_RELAY_GOODBYE_WAIT = 5.0

#: The handshake's ``role`` field carries the dialer's topology, so the
#: accepting side can refuse a mismatch before anything else happens.
ROLE_STAR = 1
ROLE_MESH = 2
#: A host relay dialing a star's coordinator for the ranks it carries.
ROLE_RELAY = 3
_ROLE_NAMES = {ROLE_STAR: "star", ROLE_MESH: "mesh", ROLE_RELAY: "relay"}

#: Accept-loop poll period: how quickly close() stops the listener.
_ACCEPT_POLL = 0.2
#: How many refusals ``group.refused`` keeps (the newest).
MAX_REFUSED = 256
#: accept() errors that leave the listener usable (resource exhaustion, a
#: connection reset before it was accepted).
_TRANSIENT_ACCEPT_ERRORS = frozenset(
    getattr(errno, name) for name in ("EMFILE", "ENFILE", "ENOBUFS", "ENOMEM", "ECONNABORTED",
                                      "EPROTO", "EPERM", "ETIMEDOUT")
    if hasattr(errno, name))


def parse_address(address: str, *, what: str = "address") -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> ``(host, port)``, with a clear error."""
    text = str(address).strip()
    if text.startswith("tcp://"):
        text = text[len("tcp://"):]
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"{what} {address!r} must be host:port (e.g. 127.0.0.1:29500)")
    host = host.strip("[]")
    try:
        number = int(port)
    except ValueError:
        raise ConfigError(f"{what} {address!r}: port {port!r} is not a number") from None
    if not 0 <= number < 65536:
        raise ConfigError(f"{what} {address!r}: port {number} is out of range 0..65535")
    return host, number


def send_refusal(channel: wire.Channel, problem: str) -> None:
    """Tell a peer just handshaken why it is not admitted (best effort), then close its link."""
    try:
        channel.send(KIND_CONTROL, TAG_WELCOME, {"ok": False, "error": problem})
    except (MeshError, OSError):
        pass
    channel.close()


def format_address(sockname: Any) -> str:
    """``host:port`` of a socket name, the host bracketed when it is IPv6."""
    host, port = sockname[0], sockname[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen(address: str, what: str) -> socket.socket:
    """A listening socket on ``address`` whose accept() wakes every _ACCEPT_POLL s.

    A failure to bind is a :class:`ConfigError` naming ``what``.
    """
    host, port = parse_address(address, what=what)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {what} {address}: {exc}") from None
    sock.settimeout(_ACCEPT_POLL)
    return sock


def dial(host: str, port: int, deadline: float, attempt_timeout: float,
         unreachable: Callable[[OSError | None], MeshError],
         closed: Callable[[], bool] = lambda: False) -> socket.socket:
    """A TCP connection to ``host:port``, retried with backoff until ``deadline``.

    The peer may not be listening yet: each failed attempt waits (50 ms,
    doubling, at most 0.5 s) and tries again. Past ``deadline``,
    ``unreachable(last error)`` is raised; once ``closed()`` is true, the
    dialer's group was closed and the wait ends at once.
    """
    delay = 0.05
    last: OSError | None = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise unreachable(last)
        try:
            return socket.create_connection((host, port),
                                            timeout=max(0.05, min(remaining, attempt_timeout)))
        except OSError as exc:
            if closed():
                raise PeerLostError("the group was closed while connecting") from exc
            last = exc
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.5)


#: How many handshakes one listener runs at once (each is a thread and a
#: descriptor). A connection past it closes the oldest handshake still in
#: progress, so connections held open without a word cannot keep a real
#: node out: its handshake takes milliseconds, theirs never ends.
MAX_HANDSHAKES = 64


class HandshakeSlots:
    """The handshakes in progress on one listener, at most ``limit``, oldest first."""

    def __init__(self, limit: int = MAX_HANDSHAKES) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._pending: dict[socket.socket, str] = {}  # insertion order: oldest first

    def take(self, sock: socket.socket, where: str) -> tuple[socket.socket, str] | None:
        """Hold a slot for ``sock``; the oldest handshake it displaces, if the slots were full."""
        with self._lock:
            self._pending[sock] = where
            if len(self._pending) <= self.limit:
                return None
            oldest = next(iter(self._pending))
            return oldest, self._pending.pop(oldest)

    def release(self, sock: socket.socket) -> None:
        with self._lock:
            self._pending.pop(sock, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)


def _daemon(target: Callable[[], None]) -> None:
    threading.Thread(target=target, name="meshkit-tcp-admit", daemon=True).start()


def accept_loop(listener: socket.socket, running: Callable[[], bool], who: str,
                admit: Callable[[socket.socket, str], None],
                refuse: Callable[[str, str], None], *,
                spawn: Callable[[Callable[[], None]], Any] | None = None,
                slots: HandshakeSlots | None = None) -> None:
    """Accept connections on ``listener`` while ``running()``; ``admit(sock, where)`` each.

    Each ``admit`` runs on a thread of its own (``spawn(target)`` starts it,
    so its owner can track it; default: a daemon thread), and holds its slot
    until it returns: ``admit`` runs the handshake itself, it does not start
    another thread for it (that would free the slot at once),
    so a peer that connects and says nothing cannot stall the ones queued
    behind it; at most ``slots.limit`` (:data:`MAX_HANDSHAKES`) run at once:
    a connection past that shuts the oldest one still running down (it is
    passed to ``refuse``, so it is logged and counted). When no thread can be
    started the connection is dropped and passed to ``refuse``. An accept()
    error that leaves the listener usable (out of descriptors or memory) is
    logged and retried after a pause rather than ending the loop, so a flood
    cannot keep every later rank out.
    """
    slots = slots if slots is not None else HandshakeSlots()
    start = spawn if spawn is not None else _daemon
    while running():
        try:
            sock, peer = listener.accept()
        except socket.timeout:
            continue
        except OSError as exc:
            if running() and exc.errno in _TRANSIENT_ACCEPT_ERRORS:
                log.warning("%s: cannot accept a connection (%s); retrying", who, exc)
                time.sleep(_ACCEPT_POLL)
                continue
            if running():
                log.warning("%s: the listener failed; no more ranks can join", who,
                            exc_info=True)
            return
        where = format_address(peer)
        displaced = slots.take(sock, where)
        if displaced is not None:
            refuse(displaced[1], f"{slots.limit} handshakes were in progress and this was the "
                                 f"oldest; closed to make room (MAX_HANDSHAKES)")
            # Shut down only: the handshake's own thread fails, closes it and ends.
            try:
                displaced[0].shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        def run(sock: socket.socket = sock, where: str = where) -> None:
            try:
                admit(sock, where)
            finally:
                slots.release(sock)

        try:
            start(run)
        except RuntimeError as exc:  # out of threads: drop this one
            slots.release(sock)
            sock.close()
            refuse(where, f"no thread to run its handshake: {exc}")


class TcpLinks(Links):
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
        self._relays: dict[str, _RelayLink] = {}
        self._via: dict[int, str] = {}
        #: Body bytes this rank received and sent (benchmarks/scale.py reads them).
        self.bytes_in = 0
        self.bytes_out = 0
        #: (peer, tag) -> the wire placers the kernel registered for that
        #: peer's frames (receive_into); read by the peer's reader thread.
        self._placers: dict[tuple[int, int], list[Any]] = {}

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

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
                self.bytes_out += channel.forward(message.raw, sender=message.src,
                                                  deadline=message.deadline)
                return
            meta: Any = message.meta
            if message.dst != peer or peer in self._via:
                # A relay's connection carries several ranks: it needs the destination.
                meta = {**meta, "dst": message.dst}
            # No copy of the payload when there is no metadata (an activation).
            state = {**message.payload, META_KEY: dict(meta)} if meta else message.payload
            model = message.kind == "model"
            self.bytes_out += channel.send(KIND_MODEL if model else KIND_CONTROL, message.tag,
                                           state, deadline=message.deadline)
        except PeerLostError as exc:
            self._events.lost(peer, str(exc))
            raise
        except WireError:
            if channel.closed:  # a write failure, not a payload we could not encode
                self._events.lost(peer, "the connection broke while sending")
            raise

    def drop(self, peer: int) -> None:
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
        while True:
            try:
                frame = channel.recv(timeout=None, place=place)
            except (PeerLostError, WireError) as exc:
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
                                   _KIND_NAMES.get(frame.kind, "control"), raw=frame))
            # Blocked in the next recv, this reader must not keep the frame it
            # delivered alive: one reader per peer would hold a model per peer.
            del frame, state

    def _handshake(self, sock: socket.socket, timeout: float) -> wire.Channel:
        return wire.handshake(
            sock, self.config.secret, rank=self.rank, world=self.world_size,
            role=ROLE_STAR if self.is_star else ROLE_MESH,
            timeout=self.timeout, handshake_timeout=timeout, max_frame=self.max_frame,
            encrypt=self.config.encrypt, node_key=self.config.node_key,
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
        if problem is None:
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
        try:
            self._register(rank, channel)
        finally:
            # Only now that the rank is in the routing table: released any
            # earlier, a second node claiming it could be welcomed too.
            with self._lock:
                self._admitting.discard(rank)

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
        theirs = _ROLE_NAMES.get(role, f"unknown ({role})")
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
                self._lock.wait_for(lambda: rank not in self._channels, _STALE_LINK_WAIT)
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

    # -- host relays (the coordinator's side; meshkit_tcp.relay is the relay's) ------

    def _admit_relay(self, channel: wire.Channel, where: str) -> None:
        """A host relay handshook: check what it announces, welcome it, read its link."""
        try:
            hello = channel.recv(timeout=self.timeout)
        except (MeshError, OSError) as exc:
            channel.close()
            self._refuse(f"{where} (relay)", f"sent no relay hello: {exc}")
            return
        name, ranks, problem = self._relay_problem(channel, hello)
        if problem is not None:
            send_refusal(channel, problem)
            self._refuse(f"{where} (relay {name!r})", problem)
            return
        link = _RelayLink(name, channel, frozenset(ranks))
        with self._lock:
            # Registered before the welcome, so a rank joining through it at
            # once finds it; _relay_problem reserved the name and ranks.
            self._relays[name] = link
            self._admitting.difference_update(ranks)
            self._lock.notify_all()
        try:
            channel.send(KIND_CONTROL, TAG_WELCOME, {"ok": True, "topology": "star"})
        except (MeshError, OSError) as exc:
            self._relay_lost(link, f"the welcome could not be sent: {exc}")
            return
        log.info("rank 0: host relay %r at %s carries ranks %s", name, where, sorted(ranks))
        self._spawn(self._relay_reader, link, name=f"meshkit-tcp-relay-{name}")

    def _relay_problem(self, channel: wire.Channel, hello: wire.Frame
                       ) -> tuple[str, list[int], str | None]:
        """(name, ranks, why the relay may not join or None); reserves the ranks if not."""
        state = hello.state
        name, ranks = state.get("name"), state.get("ranks")
        if hello.tag != TAG_RELAY_CTL or state.get("op") != "hello":
            return "?", [], "a relay must start with its hello (the ranks it carries)"
        if not isinstance(name, str) or not name or len(name) > 200:
            return "?", [], f"a relay needs a name of 1..200 characters, got {name!r}"
        if (not isinstance(ranks, list) or not ranks or len(ranks) >= self.world_size
                or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks)):
            return name, [], f"relay {name!r} announced no valid list of ranks ({ranks!r})"
        if not self.is_coordinator or not self.is_star:
            return name, [], "only a star's coordinator (rank 0) accepts host relays"
        authorized = self.config.authorized_nodes
        for rank in ranks:
            if not 1 <= rank < self.world_size:
                return name, [], (f"relay {name!r} announced rank {rank}, outside the workers "
                                  f"1..{self.world_size - 1}")
            if authorized is not None:
                problem = authorized.problem(channel.peer_key, rank)
                if problem is not None:
                    return name, [], f"relay {name!r} may not carry rank {rank}: {problem}"
        dead = {r: self._events.dead_reason(r) for r in ranks}
        with self._lock:
            if name in self._relays:
                return name, [], f"a host relay named {name!r} is already connected"
            for rank in ranks:
                if dead[rank] is not None:
                    return name, [], (f"rank {rank} was declared dead ({dead[rank]}); a dead "
                                      f"rank cannot rejoin this run")
                if rank in self._channels or rank in self._admitting:
                    return name, [], (f"relay {name!r} announced rank {rank}, which is "
                                      f"already connected")
                owner = [n for n, link in self._relays.items() if rank in link.ranks]
                if owner:
                    return name, [], (f"relay {name!r} announced rank {rank}, which relay "
                                      f"{owner[0]!r} carries; give each relay its own ranks")
            if len(set(ranks)) != len(ranks):
                return name, [], f"relay {name!r} announced a rank twice: {ranks}"
            self._admitting.update(ranks)
        return name, sorted(ranks), None

    def _relay_reader(self, link: _RelayLink) -> None:
        """Read a relay's connection: its ranks' frames, and who joined or died behind it."""
        try:
            self._read_relay(link)
        finally:
            link.read_to_end.set()

    def _read_relay(self, link: _RelayLink) -> None:
        events = self._events
        while True:
            try:
                frame = link.channel.recv(timeout=None)
            except (PeerLostError, WireError) as exc:
                self._relay_lost(link, str(exc))
                return
            except Exception as exc:  # a decoder bug must still drop the relay, not hang
                log.exception("rank 0: unexpected error reading from relay %r", link.name)
                self._relay_lost(link, f"unexpected {type(exc).__name__}: {exc}")
                return
            if frame.tag == TAG_BYE:
                self._relay_lost(link, "closed its connection (left the mesh)", quiet=True)
                return
            self.bytes_in += frame.nbytes
            link.bytes_in += frame.nbytes
            state = frame.state
            if frame.tag == TAG_RELAY_CTL:
                problem = self._relay_news(link, state)
                if problem is not None:
                    self._relay_lost(link, f"protocol violation: {problem}")
                    return
                continue
            meta = state.pop(META_KEY, None) or {}
            src = frame.sender
            # A relay speaks for its joined ranks only; its own answers (to a
            # TAG_RELAY request) name a rank it carries.
            allowed = link.ranks if frame.tag == TAG_REPLY and "relay" in state else link.joined
            if not isinstance(meta, dict) or src not in allowed:
                self._relay_lost(link, (
                    f"protocol violation: sent a frame for rank {src}, which it does not "
                    f"carry (or with a malformed {META_KEY!r} entry)"))
                return
            dst = meta.get("dst", self.rank)
            if isinstance(dst, bool) or not isinstance(dst, int) or not 0 <= dst < self.world_size:
                self._relay_lost(link, f"protocol violation: a frame for invalid rank {dst!r}")
                return
            if (events.dead_reason(src) is not None and "relay" not in state
                    and src not in link.joined):
                # A late frame from a rank declared dead (its link was dropped);
                # one that rejoined since is returning, and heard like a direct one.
                continue
            events.deliver(Message(src, dst, frame.tag, state, meta,
                                   _KIND_NAMES.get(frame.kind, "control"), raw=frame))
            del frame, state

    def _relay_news(self, link: _RelayLink, state: dict[str, Any]) -> str | None:
        """A relay's control message (a rank joined or was lost behind it); a problem or None."""
        op, rank = state.get("op"), state.get("rank")
        if rank not in link.ranks:
            return f"control {op!r} for rank {rank!r}, which it does not carry"
        if op == "joined":
            with self._lock:
                if self._events.dead_reason(rank) is not None and rank in link.joined:
                    # Restarted behind the relay, declared dead, its old link not
                    # dropped yet (the ledger marks a death before the group drops
                    # the link): wait for that drop, bounded. A dead rank that
                    # joins is *returning*, as on a direct link.
                    self._lock.wait_for(lambda: rank not in link.joined, _STALE_LINK_WAIT)
                if self._events.closed or rank in link.joined:
                    return None
                link.joined.add(rank)
                self._channels[rank] = link.channel
                self._via[rank] = link.name
                self._lock.notify_all()
            self._events.linked(rank)
            return None
        if op == "lost":
            reason = str(state.get("reason") or "lost")
            with self._lock:
                link.reported.add(rank)
            self._events.lost(rank, f"lost behind host relay {link.name!r}: {reason}",
                              quiet=bool(state.get("quiet")))
            return None
        return f"unknown control {op!r}"

    def _relay_lost(self, link: _RelayLink, reason: str, *, quiet: bool = False) -> None:
        """A relay's connection is gone: it takes the ranks that joined through it with it.

        A rank it announced that never joined is not dead, only still
        missing: another relay (the same one restarted) may carry it.
        """
        with self._lock:
            if self._relays.get(link.name) is not link:
                return
            del self._relays[link.name]
            joined = sorted(link.joined)
            for rank in link.ranks:
                if self._via.get(rank) == link.name:
                    del self._via[rank]
                    self._channels.pop(rank, None)
            self._admitting.difference_update(link.ranks)
            self._lock.notify_all()
        link.channel.close()
        if self._events.closed:
            return
        log.log(logging.INFO if quiet else logging.WARNING,
                "rank 0: host relay %r lost (%s); its joined ranks %s go with it", link.name,
                reason, joined)
        for rank in joined:
            self._events.lost(rank, f"its host relay {link.name!r} was lost: {reason}",
                              quiet=quiet)
        with self._lock:
            self._lock.notify_all()  # whoever waits on the group sees the deaths

    # -- dialing side ---------------------------------------------------------

    def _dial(self, rank: int, address: str, deadline: float) -> None:
        host, port = parse_address(address, what=f"rank {rank}'s address")
        sock = dial(host, port, deadline, self.timeout, lambda exc: PeerLostError(
            f"rank {self.rank} could not reach rank {rank} at {address} within "
            f"{self.timeout:g} s; is it running and listening there?"),
            closed=lambda: self._events.closed)
        channel = self._handshake(sock, max(0.001, deadline - time.monotonic()))
        if channel.peer.rank != rank:
            channel.close()
            raise WireError(
                f"the node at {address} is rank {channel.peer.rank}, expected rank {rank}; "
                f"check the peers list (index = rank)")
        try:
            frame = channel.recv(timeout=max(0.001, deadline - time.monotonic()))
        except PeerLostError as exc:
            channel.close()
            raise PeerLostError(f"rank {rank} at {address} accepted the handshake but sent no "
                                f"welcome: {exc}") from None
        if frame.tag != TAG_WELCOME or not isinstance(frame.state.get("ok"), bool):
            channel.close()
            raise WireError(f"rank {rank} at {address} answered the handshake with an "
                            f"unexpected frame (tag 0x{frame.tag:X}); is it a meshkit node of "
                            f"the same release?")
        if not frame.state["ok"]:
            channel.close()
            raise WireError(f"rank {rank} at {address} refused rank {self.rank}: "
                            f"{frame.state.get('error')}")
        topology = frame.state.get("topology")
        mine = "star" if self.is_star else "mesh"
        if topology != mine:
            channel.close()
            raise WireError(f"rank {rank} at {address} runs a {topology} topology, this node "
                            f"(rank {self.rank}) a {mine}; give every node the same peers form")
        self._register(rank, channel)

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


class TcpGroup(Group):
    """One rank's handle on a TCP star or mesh: a :class:`meshkit.transport.Group` over :class:`TcpLinks`.

    Everything it does is the kernel's; it only shows what its links count
    (``refused``, ``bytes_in``, ``bytes_out``, ``relay_bytes_in``,
    ``discovery_port``), read-only.
    """

    def __init__(self, links: TcpLinks, *, max_unread: int) -> None:
        super().__init__(links, rank=links.rank, world_size=links.world_size,
                         timeout=links.timeout, is_star=links.is_star, max_unread=max_unread)
        self._tcp = links

    @property
    def links(self) -> TcpLinks:
        """This group's TCP links (their sockets and counters; for diagnostics and tests)."""
        return self._tcp

    @property
    def refused(self) -> list[str]:
        """Connections refused or failed at the handshake (the newest 256, newest last)."""
        return self._tcp.refused

    @property
    def bytes_in(self) -> int:
        """Frame body bytes this rank received."""
        return self._tcp.bytes_in

    @property
    def bytes_out(self) -> int:
        """Frame body bytes this rank sent."""
        return self._tcp.bytes_out

    @property
    def relay_bytes_in(self) -> dict[str, int]:
        """Coordinator: body bytes each connected host relay sent up, by name (its ranks'
        frames and its own answers); a part of ``bytes_in``."""
        return self._tcp.relay_bytes_in

    @property
    def discovery_port(self) -> int | None:
        """The UDP port of this rank's discovery responder, or None without one."""
        discovery = self._tcp.discovery
        return None if discovery is None else discovery.port


@attrs.define(eq=False)
class _RelayLink:
    """A host relay's connection to the coordinator: the ranks it may carry, those that joined."""

    name: str
    channel: wire.Channel
    ranks: frozenset[int]
    joined: set[int] = attrs.Factory(set)
    #: Ranks whose loss the relay itself reported (no need to tell it back).
    reported: set[int] = attrs.Factory(set)
    #: Body bytes received on this connection (``group.relay_bytes_in``).
    bytes_in: int = 0
    #: Set when its reader ended (the relay said goodbye, or its connection went).
    read_to_end: threading.Event = attrs.Factory(threading.Event)


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


class TcpTransport:
    """Factory result of the ``tcp`` component: ``connect(node_config) -> Group``."""

    def __init__(self, options: TcpOptions | None = None, *,
                 benchmark_only_disable_mac: bool = False, relay_factory: Any = None) -> None:
        self.options = options if options is not None else TcpOptions()
        # Never reachable from config: only benchmarks/allreduce.py builds a
        # transport this way, on every rank, to measure what the MAC costs.
        self._benchmark_only_disable_mac = benchmark_only_disable_mac
        # meshkit_tcp.relay's start_relay (the component factory passes it in:
        # the relay builds on this module, so this module cannot import it).
        self._relay_factory = relay_factory

    def start_relay(self, **settings: Any) -> HostRelay:
        """Start a host relay (``meshkit relay``); ``settings`` are ``RelayConfig``'s fields.

        Returns the running :class:`meshkit_tcp.relay.HostRelay` (its
        ``address``, ``serve()``, ``close()``).
        """
        if self._relay_factory is None:
            raise ConfigError("this tcp transport was built without host relay support; "
                              "create it with meshkit.plugins.create('transport', 'tcp')")
        return self._relay_factory(self.options, **settings)

    def connect(self, config: NodeConfig) -> TcpGroup:
        if not config.secret:
            raise ConfigError(
                "no secret: every meshkit connection is authenticated with a shared secret; "
                "set secret_file in [mesh] or MESHKIT_SECRET (the same on every node)")
        if len(config.secret) < wire.MIN_SECRET:
            raise ConfigError(
                f"the shared secret is {len(config.secret)} bytes; use at least "
                f"{wire.MIN_SECRET} random bytes (e.g. `openssl rand -hex 32 > secret`)")
        secret: bytes = config.secret
        server = None
        # A star's coordinator listens first and then announces the port it
        # actually bound (bind may be port 0); everyone else resolves first.
        announce = config.discover and not config.peers and config.rank == 0 and config.is_star
        if announce:
            config = attrs.evolve(config, bind=config.bind or f"0.0.0.0:{config.data_base}")
        elif config.discover and not config.peers:
            config, server = resolve(config)
        try:
            max_unread = int(self.options.max_unread_bytes)
            if not 0 < max_unread < 1 << 63:
                raise ConfigError(f"[transport] max_unread_bytes must be a positive byte count "
                                  f"below 2**63, got {max_unread}")
            links = TcpLinks(config, self.options,
                             benchmark_only_disable_mac=self._benchmark_only_disable_mac)
            group = TcpGroup(links, max_unread=max_unread)
        except BaseException:
            if server is not None:
                server.close()
            raise
        links.discovery = server
        if server is not None:
            server.linked = links.has_link
        try:
            links.start()
            if announce:
                port = int(links.address.rpartition(":")[2])
                links.discovery = DiscoveryServer(secret, config.world, data_port=port,
                                                  port=config.disc_port, topology="star",
                                                  linked=links.has_link)
                log.info("rank 0: discovery responder on UDP port %d announces TCP port %d",
                         links.discovery.port, port)
        except BaseException:
            group.close()
            raise
        return group
