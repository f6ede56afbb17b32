"""The tcp host relay (``meshkit relay``): one connection to the coordinator for a host's ranks.

Rule: a relay forwards every frame between its ranks and the coordinator
unchanged (the authenticated body is re-tagged under the other connection's
keys, never re-encoded), except the requests addressed to the relay itself
(``TAG_RELAY``: ``fold`` and ``fanout``), which it hands to the kernel
(:func:`meshkit.train.answer_relay_request`, over a
:class:`meshkit.train.RelayPool` of its own ranks) and answers once. What a
relay does with a round lives in ``meshkit/train/_rounds/relayed.py``; this
module only carries the bytes.

Both legs run the ordinary handshake (shared secret, encryption, world
size): the ranks dial the relay exactly as they would dial the coordinator
(``meshkit node --peers RELAY_ADDR``), the relay dials the coordinator with
the handshake role ``relay`` and announces the ranks it carries. It accepts
only those ranks. A rank lost here is reported upstream; a death the
coordinator declares arrives as control and drops the rank here. When the
coordinator goes, the relay closes every local link and ends; it also ends
once every rank it carries has left.

Frames for a local rank are written on the thread that reads the
coordinator's connection, under the channel's stall timeout: a local rank
that stops reading holds the relay's downstream traffic up to that timeout,
then it is dropped (and reported) as stalled.

A relay decrypts what passes through it: it sees its ranks' models in clear.
Run it on the host whose ranks it carries (docs/scaling-out.md).
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from typing import Any, Mapping

import attrs

from meshkit import wire
from meshkit.errors import ConfigError, MeshError, PeerLostError, ProtocolError, WireError
from meshkit.train import RelayPool, answer_relay_request, decode, encode
from meshkit.transport import (
    META_KEY,
    Membership,
    TAG_BYE,
    TAG_RELAY,
    TAG_RELAY_CTL,
    TAG_REPLY,
    TAG_REQUEST,
    TAG_WELCOME,
)

from meshkit_tcp.joining import KIND_CONTROL, MAX_REFUSED, ROLE_RELAY, ROLE_STAR, send_refusal
from meshkit_tcp.sockets import accept_loop, dial, format_address, listen, parse_address

__all__ = ["RelayConfig", "RelayReport", "HostRelay", "start_relay", "serve_relay"]

log = logging.getLogger(__name__)

#: Frames that may wait for one local rank's writer. A rank that stops reading
#: stalls only its own writer (whose write timeout then declares it lost);
#: more than this many frames waiting for it declare it lost at once.
_DOWN_QUEUE = 32

#: Seconds at most (and at most the relay's timeout) that a closing relay
#: spends delivering the frames queued for its ranks, and that a failed write
#: to the coordinator waits for the coordinator's reader to say why.
_FLUSH_TIMEOUT = 10.0


@attrs.frozen
class RelayConfig:
    """What ``meshkit relay`` is started with.

    ``coordinator``: the coordinator's ``host:port``; ``bind``: where this
    host's ranks dial the relay (port 0: any free port, ``relay.address``
    says which); ``ranks``: the global ranks this relay carries.
    """

    coordinator: str
    bind: str
    world: int
    ranks: tuple[int, ...]
    secret: bytes = attrs.field(repr=False)
    name: str = ""
    timeout: float = 30.0
    encrypt: bool = True
    node_key: Any = attrs.field(default=None, repr=False)
    #: A :class:`meshkit.wire.AuthorizedNodes`: the node keys this relay admits
    #: for its ranks (``meshkit relay --authorized-nodes``); None: any node
    #: holding the secret, whose identity is then the relay's.
    authorized_nodes: Any = attrs.field(default=None, repr=False)
    max_frame: int = wire.DEFAULT_MAX_FRAME
    #: The most one frame of a model-sized message carries, on both legs
    #: (``meshkit relay --segment-bytes``; each link cuts at the smaller of its
    #: two ends' values).
    segment_bytes: int = wire.DEFAULT_SEGMENT_BYTES
    #: The largest segmented message accepted (``[transport] max_message_bytes``).
    max_message: int = wire.DEFAULT_MAX_MESSAGE

    def __attrs_post_init__(self) -> None:
        if not self.ranks:
            raise ConfigError("a relay needs the ranks it carries (--ranks 1,2)")
        bad = [r for r in self.ranks if not 1 <= r < self.world]
        if bad:
            raise ConfigError(f"relay ranks {bad} are outside the workers 1..{self.world - 1} "
                              f"of a world of {self.world}")
        if len(set(self.ranks)) != len(self.ranks):
            raise ConfigError(f"relay ranks {list(self.ranks)} name a rank twice")
        if not self.secret or len(self.secret) < wire.MIN_SECRET:
            raise ConfigError(
                f"a relay needs the run's shared secret (at least {wire.MIN_SECRET} bytes): "
                f"--secret-file or MESHKIT_SECRET")
        if not 0 < self.timeout <= 1e9:
            raise ConfigError(f"timeout must be positive seconds, got {self.timeout}")


@attrs.frozen
class RelayReport:
    """What a relay did, once it ended."""

    name: str
    ranks: tuple[int, ...]
    joined: tuple[int, ...]
    dead: Mapping[int, str]
    folds: int
    fanouts: int
    frames_up: int
    frames_down: int
    stopped: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "ranks": list(self.ranks), "joined": list(self.joined),
                "dead": {str(r): why for r, why in self.dead.items()}, "folds": self.folds,
                "fanouts": self.fanouts, "frames_up": self.frames_up,
                "frames_down": self.frames_down, "stopped": self.stopped}


def _finish_writer(box: queue.Queue[tuple[Any, ...] | None], deadline: float) -> None:
    """End a local rank's writer after the frames queued for it (the relay is closing)."""
    try:
        box.put(None, timeout=max(0.0, deadline - time.monotonic()))
    except queue.Full:  # it stopped reading: its frames are dropped with it
        _stop_writer(box)


def _stop_writer(box: queue.Queue[tuple[Any, ...] | None]) -> None:
    """End a local rank's writer: its queued frames are dropped (the rank is gone)."""
    while True:
        try:
            box.get_nowait()
        except queue.Empty:
            break
    try:
        box.put_nowait(None)
    except queue.Full:  # a frame was queued in between: the writer ends on its error
        pass


class HostRelay:
    """One host relay: the upstream connection, the local ranks' links, the relay's own work."""

    def __init__(self, config: RelayConfig) -> None:
        self.config = config
        self.name = config.name or f"relay-{'-'.join(map(str, config.ranks))}"
        self.ranks = frozenset(config.ranks)
        self.folds = 0
        self.fanouts = 0
        self.frames_up = 0
        self.frames_down = 0
        #: Connections refused at the handshake (newest last), as the tcp group keeps them.
        self.refused: list[str] = []
        self._lock = threading.Condition()
        #: The relay's view of its ranks (it stands for rank 0 to them): who
        #: joined, who is dead and why, who said goodbye (when all have, the
        #: relay ends). Decided there, under this relay's lock.
        self._members = Membership(0, cv=self._lock)
        self._down: dict[int, wire.Channel] = {}
        #: Per local rank: the frames its writer thread sends, in order.
        self._outbox: dict[int, queue.Queue[tuple[Any, ...] | None]] = {}
        self._admitting: set[int] = set()
        #: Per local rank: its writer thread (joined when the relay closes).
        self._writers: dict[int, threading.Thread] = {}
        self._up: wire.Channel | None = None
        self._listener: socket.socket | None = None
        self._address = ""
        self._closed = threading.Event()
        self._done = threading.Event()
        self._stopped = ""
        self._work: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._pool = RelayPool(self)

    # -- state ------------------------------------------------------------------

    @property
    def address(self) -> str:
        """Where this host's ranks dial the relay (``host:port``, once bound)."""
        return self._address

    @property
    def dead(self) -> dict[int, str]:
        return self._members.dead()

    @property
    def joined(self) -> set[int]:
        return set(self._members.joined())

    def report(self) -> RelayReport:
        with self._lock:
            return RelayReport(self.name, tuple(sorted(self.ranks)),
                               tuple(self._members.joined()), self._members.dead(), self.folds,
                               self.fanouts, self.frames_up, self.frames_down, self._stopped)

    # -- bring-up -----------------------------------------------------------------

    def start(self) -> HostRelay:
        """Listen for the ranks, then dial the coordinator and announce them.

        In this order, a relay that cannot listen (``--bind`` in use) fails
        before the coordinator has heard of it: announced ranks that then
        never join would only be missing, but a relay that cannot serve
        them should not be announced at all.
        """
        cfg = self.config
        try:
            self._listener = listen(cfg.bind, "relay bind address")
            self._address = format_address(self._listener.getsockname())
            self._up = self._dial_up()
        except BaseException:
            self.close()
            raise
        self._spawn(self._up_reader, name=f"meshkit-relay-{self.name}-up")
        self._spawn(self._accept_loop, name=f"meshkit-relay-{self.name}-accept")
        self._spawn(self._serve_work, name=f"meshkit-relay-{self.name}-work")
        log.info("relay %r: carries ranks %s, listening at %s", self.name, sorted(self.ranks),
                 self.address)
        return self

    def _dial_up(self) -> wire.Channel:
        cfg = self.config
        host, port = parse_address(cfg.coordinator, what="coordinator address")
        deadline = time.monotonic() + cfg.timeout
        sock = dial(host, port, deadline, cfg.timeout, lambda exc: PeerLostError(
            f"relay {self.name!r} could not reach the coordinator at {cfg.coordinator} "
            f"within {cfg.timeout:g} s: {exc}"))
        channel = wire.handshake(
            sock, cfg.secret, rank=min(self.ranks), world=cfg.world, role=ROLE_RELAY,
            timeout=cfg.timeout, handshake_timeout=max(0.05, deadline - time.monotonic()),
            max_frame=cfg.max_frame, encrypt=cfg.encrypt, node_key=cfg.node_key,
            segment=cfg.segment_bytes, max_message=cfg.max_message)
        if channel.peer.rank != 0:
            channel.close()
            raise WireError(f"the node at {cfg.coordinator} is rank {channel.peer.rank}, not "
                            f"the coordinator (rank 0)")
        try:
            channel.send(KIND_CONTROL, TAG_RELAY_CTL,
                         {"op": "hello", "name": self.name, "ranks": sorted(self.ranks)})
            frame = channel.recv(timeout=max(0.05, deadline - time.monotonic()))
        except (PeerLostError, WireError):
            channel.close()
            raise
        if frame.tag != TAG_WELCOME or not isinstance(frame.state.get("ok"), bool):
            channel.close()
            raise WireError(f"the coordinator at {cfg.coordinator} answered the relay's hello "
                            f"with an unexpected frame (tag 0x{frame.tag:X})")
        if not frame.state["ok"]:
            channel.close()
            raise WireError(f"the coordinator at {cfg.coordinator} refused relay "
                            f"{self.name!r}: {frame.state.get('error')}")
        return channel

    def _spawn(self, target: Any, *args: Any, name: str) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        return thread

    # -- running ------------------------------------------------------------------

    def serve(self, timeout: float | None = None) -> RelayReport:
        """Block until the coordinator ends the run (or is lost); the relay's report."""
        self._closed.wait(timeout)
        self.close()
        return self.report()

    def close(self, reason: str = "closed") -> None:
        """Leave: every local link and the upstream connection close. Idempotent."""
        with self._lock:
            closing = self._closed.is_set()
            if not closing:
                self._stopped = self._stopped or reason
                self._closed.set()
        if closing:
            # Another thread is saying goodbye: let it finish before the caller
            # (serve(), then the process) goes.
            self._done.wait(_FLUSH_TIMEOUT + 5.0)
            return
        with self._lock:
            channels = list(self._down.values())
            self._down.clear()
            boxes = list(self._outbox.values())
            self._outbox.clear()
            writers = list(self._writers.values())
            self._writers.clear()
            up, self._up = self._up, None
            self._lock.notify_all()
        # What the coordinator sent before its goodbye (the `shutdown` jobs)
        # is delivered before the goodbye: each writer ends after its queued
        # frames, each write under the channel's stall timeout, all of them
        # within the relay's timeout.
        deadline = time.monotonic() + min(self.config.timeout, _FLUSH_TIMEOUT)
        for box in boxes:
            _finish_writer(box, deadline)
        for writer in writers:
            if writer is not threading.current_thread():
                writer.join(max(0.0, deadline - time.monotonic()))
        self._work.put(None)
        self._pool.wake()
        if self._listener is not None:
            try:
                self._listener.close()
            except OSError:
                pass
        for channel in [*channels, *([up] if up is not None else [])]:
            try:
                channel.send(KIND_CONTROL, TAG_BYE, {})
            except (MeshError, OSError):
                pass
            channel.close()
        self._done.set()

    def lost(self, rank: int, reason: str, *, quiet: bool = False, tell: bool = True) -> None:
        """A local rank is gone: drop its link, tell the coordinator (unless it told us)."""
        with self._lock:
            if not self._members.declare_dead(rank, reason, left=quiet):
                return
            channel = self._down.pop(rank, None)
            box = self._outbox.pop(rank, None)
            self._writers.pop(rank, None)
            self._lock.notify_all()
        if box is not None:
            _stop_writer(box)
        if channel is not None:
            channel.close()
        self._pool.wake()
        if not self._closed.is_set():
            log.log(logging.INFO if quiet else logging.WARNING, "relay %r: rank %d lost: %s",
                    self.name, rank, reason)
        if tell:
            self._send_up_control({"op": "lost", "rank": rank, "reason": reason,
                                   "quiet": quiet})
        if self.ranks <= set(self._members.left()):
            # Nothing left to carry: every rank here said goodbye (a rank that
            # died instead may be restarted, and rejoins through the relay).
            self.close("every rank it carries has left")

    def send_down(self, rank: int, tag: int, state: Mapping[str, Any]) -> None:
        """The relay's own frame (as rank 0) to local ``rank``, through its writer."""
        if not self._queue_down(rank, ("send", tag, state)):
            raise PeerLostError(f"rank {rank} is not connected to relay {self.name!r}")

    def _queue_down(self, rank: int, item: tuple[Any, ...]) -> bool:
        """Hand ``item`` to local ``rank``'s writer; False when it is not connected."""
        with self._lock:
            box = self._outbox.get(rank)
        if box is None:
            return False
        try:
            box.put_nowait(item)
        except queue.Full:
            self.lost(rank, f"it stopped reading: {_DOWN_QUEUE} frames from the relay waited "
                            f"for it")
            return False
        return True

    def _down_writer(self, rank: int, channel: wire.Channel,
                     box: queue.Queue[tuple[Any, ...] | None]) -> None:
        """Send local ``rank``'s frames in order, so a rank that stalls stalls only this."""
        while True:
            item = box.get()
            if item is None:
                return
            try:
                if item[0] == "forward":
                    channel.forward(item[1])
                else:
                    channel.send(KIND_CONTROL, item[1], item[2])
            except (PeerLostError, WireError, OSError) as exc:
                self.lost(rank, f"a write from the relay failed: {exc}")
                return
            del item

    def _send_up(self, tag: int, state: Mapping[str, Any], sender: int) -> None:
        up = self._up
        if up is None:
            raise PeerLostError(f"relay {self.name!r} has no coordinator connection")
        up.send(KIND_CONTROL, tag, state, sender=sender)

    def _upstream_failed(self, exc: BaseException) -> None:
        """A write to the coordinator failed: its reader says why, bounded.

        The coordinator may have said goodbye and closed while this write
        was on its way: the reader, which reads the goodbye in order, then
        ends the relay as a finished run. Only if it has not within the
        timeout is the coordinator lost.
        """
        if not self._closed.wait(min(self.config.timeout, _FLUSH_TIMEOUT)):
            self.close(f"coordinator lost: {exc}")

    def _send_up_control(self, state: Mapping[str, Any]) -> None:
        try:
            self._send_up(TAG_RELAY_CTL, state, min(self.ranks))
        except (MeshError, OSError) as exc:
            log.debug("relay %r: could not tell the coordinator %s: %s", self.name, state, exc)

    # -- the coordinator's side ---------------------------------------------------------

    def _up_reader(self) -> None:
        up = self._up
        assert up is not None
        while True:
            try:
                frame = up.recv(timeout=None)
            except (PeerLostError, WireError) as exc:
                self.close(f"coordinator lost: {exc}")
                return
            if frame.tag == TAG_BYE:
                self.close("the coordinator ended the run")
                return
            if frame.tag == TAG_RELAY_CTL:
                if frame.state.get("op") == "dead" and frame.state.get("rank") in self.ranks:
                    self.lost(int(frame.state["rank"]),
                              str(frame.state.get("reason") or "declared dead by rank 0"),
                              tell=False)
                continue
            meta = frame.state.get(META_KEY) or {}
            dst = meta.get("dst") if isinstance(meta, dict) else None
            if frame.tag == TAG_RELAY:
                state = dict(frame.state)
                state.pop(META_KEY, None)
                self._work.put({"via": dst, **decode(state)})
                continue
            with self._lock:
                self.frames_down += 1
            if not (isinstance(dst, int) and self._queue_down(dst, ("forward", frame))):
                log.debug("relay %r: dropped a frame for rank %r (not connected here)",
                          self.name, dst)
            del frame

    # -- this host's ranks ----------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        accept_loop(self._listener, lambda: not self._closed.is_set(), f"relay {self.name!r}",
                    self._admit, self._refuse, spawn=lambda target: self._spawn(
                        target, name=f"meshkit-relay-{self.name}-admit"))

    def _refuse(self, where: str, message: str) -> None:
        log.warning("relay %r refused %s: %s", self.name, where, message)
        with self._lock:
            self.refused.append(f"{where}: {message}")
            del self.refused[:-MAX_REFUSED]
            self._lock.notify_all()

    def _admit(self, sock: socket.socket, where: str) -> None:
        cfg = self.config
        try:
            channel = wire.handshake(sock, cfg.secret, rank=0, world=cfg.world, role=ROLE_STAR,
                                     timeout=cfg.timeout, max_frame=cfg.max_frame,
                                     encrypt=cfg.encrypt, segment=cfg.segment_bytes,
                                     max_message=cfg.max_message)
        except (MeshError, OSError) as exc:
            if not self._closed.is_set():
                self._refuse(where, str(exc))
            return
        rank = channel.peer.rank
        problem = None
        with self._lock:
            if channel.peer.role != ROLE_STAR:
                problem = "a host relay serves star workers only"
            elif rank not in self.ranks:
                problem = (f"relay {self.name!r} carries ranks {sorted(self.ranks)}, not rank "
                           f"{rank}; point that node's --peers at its own relay or the "
                           f"coordinator")
            elif rank in self._down or rank in self._admitting:
                problem = f"rank {rank} is already connected to relay {self.name!r}"
            elif cfg.authorized_nodes is not None:
                why = cfg.authorized_nodes.problem(channel.peer_key, rank)
                problem = (None if why is None else
                           f"relay {self.name!r} checks node keys (--authorized-nodes): {why}")
            if problem is None:
                self._admitting.add(rank)
        if problem is not None:
            send_refusal(channel, problem)
            self._refuse(f"{where} (rank {rank})", problem)
            return
        try:
            box: queue.Queue[tuple[Any, ...] | None] = queue.Queue(_DOWN_QUEUE)
            with self._lock:
                # A rank that died and was restarted rejoins: taken back here
                # at once (a relay runs no rounds); the coordinator keeps it
                # out of the rounds until it takes it back.
                if self._members.join(rank):
                    self._members.take_back([rank])
                self._down[rank] = channel
                self._outbox[rank] = box
            # Told once its outbox exists, so the coordinator never routes to a
            # rank the relay lacks, and before the rank hears its welcome, so
            # the coordinator knows of a rank that knows it joined (a restarted
            # rank is taken back at the next round, as on a direct link). What
            # comes for it meanwhile waits in its outbox: its writer starts
            # after the welcome.
            self._send_up(TAG_RELAY_CTL, {"op": "joined", "rank": rank}, min(self.ranks))
            channel.send(KIND_CONTROL, TAG_WELCOME, {"ok": True, "topology": "star"})
            writer = self._spawn(self._down_writer, rank, channel, box,
                                 name=f"meshkit-relay-{self.name}-to-{rank}")
            with self._lock:
                if self._outbox.get(rank) is box:
                    self._writers[rank] = writer
        except (MeshError, OSError) as exc:
            self.lost(rank, f"joining failed: {exc}")
            return
        finally:
            with self._lock:
                self._admitting.discard(rank)
        self._down_reader(rank, channel)

    def _down_reader(self, rank: int, channel: wire.Channel) -> None:
        while True:
            try:
                frame = channel.recv(timeout=None)
            except (PeerLostError, WireError) as exc:
                if not self._closed.is_set():
                    self.lost(rank, str(exc))
                return
            if frame.tag == TAG_BYE:
                self.lost(rank, "closed its connection (left the mesh)", quiet=True)
                return
            if frame.sender != rank:
                self.lost(rank, f"sent a frame claiming to come from rank {frame.sender} "
                                f"(protocol violation)")
                return
            if frame.tag in (TAG_RELAY, TAG_RELAY_CTL) or (
                    frame.tag == TAG_REPLY and "relay" in frame.state):
                # Only the relay speaks for itself: a rank forging its news or its
                # answers would be believed by the coordinator.
                self.lost(rank, f"sent a host relay's own frame (tag 0x{frame.tag:X}; "
                                f"protocol violation)")
                return
            seq = frame.state.get("seq")
            if frame.tag == TAG_REPLY and self._pool.owns(seq):
                state = dict(frame.state)
                state.pop(META_KEY, None)
                try:
                    reply = decode(state)
                except ProtocolError as exc:
                    self.lost(rank, f"protocol error: {exc}")
                    return
                self._pool.deliver(rank, reply)
                continue
            up = self._up
            if up is None:
                return
            try:
                up.forward(frame)
                with self._lock:
                    self.frames_up += 1
            except (PeerLostError, WireError) as exc:
                self._upstream_failed(exc)
                return
            del frame

    # -- the relay's own work ---------------------------------------------------------------

    def _serve_work(self) -> None:
        while True:
            request = self._work.get()
            if request is None or self._closed.is_set():
                return
            op, seq, via = request.get("op"), request.get("seq"), request.get("via")
            reply = answer_relay_request(self._pool, self.ranks, self.name, request)
            if op == "fold":
                self.folds += 1
            elif op == "fanout":
                self.fanouts += 1
            reply.update(relay=self.name, seq=seq)
            sender = via if isinstance(via, int) and via in self.ranks else min(self.ranks)
            try:
                self._send_up(TAG_REPLY, encode(reply), sender)
            except (MeshError, OSError) as exc:
                self._upstream_failed(exc)
                return


def start_relay(options: Any = None, **settings: Any) -> HostRelay:
    """A started :class:`HostRelay` from :class:`RelayConfig`'s fields (the tcp options
    give its largest frame)."""
    if options is not None and "max_frame" not in settings:
        settings["max_frame"] = int(getattr(options, "max_frame_bytes", wire.DEFAULT_MAX_FRAME))
    if options is not None and "max_message" not in settings:
        settings["max_message"] = int(getattr(options, "max_message_bytes",
                                              wire.DEFAULT_MAX_MESSAGE))
    return HostRelay(RelayConfig(**settings)).start()


def serve_relay(config: RelayConfig) -> RelayReport:
    """Run a relay until its coordinator ends the run; its report."""
    relay = HostRelay(config).start()
    return relay.serve()
