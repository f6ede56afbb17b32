"""How a node joins the service: the listener, the handshake, admission, its messages.

Each connection gets a thread: the wire handshake (shared secret, node key,
encryption, bounded by the join timeout), then admission against the
service's ``authorized_nodes`` (a refused node is told why and dropped),
then HELLO with its capabilities, then DONE after each run it serves. A
connection that breaks a rule (a frame that fits no schema, a stall) is
dropped and named in the log; the service keeps serving the others. At most
:data:`MAX_LINKS` connections are open at once, so a flood of dialers cannot
exhaust threads.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any, Callable

from meshkit import wire
from meshkit.errors import MeshError, ProtocolError
from meshkit.node import NodeCaps
from meshkit.service._member import MAX_FRAME
from meshkit.service._protocol import SESSION, Done, Hello, Refused, parse, send
from meshkit.service._scheduler import NodeLink, Scheduler, admission_problem
from meshkit.service._store import Store

__all__ = ["NodeListener", "MAX_LINKS"]

log = logging.getLogger(__name__)

#: Open node connections at most (joining ones included).
MAX_LINKS = 1024


class NodeListener:
    """Accepts nodes on a bound socket and hands them to the scheduler."""

    def __init__(self, sock: socket.socket, *, secret: bytes, store: Store,
                 scheduler: Scheduler, authorized: Callable[[], wire.AuthorizedNodes | None],
                 timeout: float, encrypt: bool = True) -> None:
        self._sock = sock
        self._secret = secret
        self._store = store
        self._scheduler = scheduler
        self._authorized = authorized
        self._timeout = timeout
        self._encrypt = encrypt
        self._closing = threading.Event()
        self._slots = threading.BoundedSemaphore(MAX_LINKS)
        self._channels: set[Any] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="meshkit-serve-accept",
                                        daemon=True)

    @property
    def address(self) -> str:
        host, port = self._sock.getsockname()[:2]
        return f"{host}:{port}"

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closing.set()
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            channels = list(self._channels)
        for channel in channels:
            channel.close("the service is shutting down")
        self._thread.join(timeout=5)

    def _accept(self) -> None:
        self._sock.settimeout(0.5)
        while not self._closing.is_set():
            try:
                conn, peer = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                log.warning("refusing %s: %d node connections open already", peer, MAX_LINKS)
                conn.close()
                continue
            threading.Thread(target=self._serve_link, args=(conn, f"{peer[0]}:{peer[1]}"),
                             name=f"meshkit-serve-node-{peer[1]}", daemon=True).start()

    def _serve_link(self, conn: socket.socket, peer: str) -> None:
        link = None
        try:
            channel = wire.handshake(conn, self._secret, rank=0, world=2, session=SESSION,
                                     timeout=self._timeout, max_frame=MAX_FRAME,
                                     encrypt=self._encrypt)
        except MeshError as exc:
            log.warning("node at %s failed the handshake: %s", peer, exc)
            self._slots.release()
            return
        with self._lock:
            self._channels.add(channel)
        try:
            link = self._admit(channel, peer)
            if link is None:
                return
            self._scheduler.node_joined(link)
            while not self._closing.is_set():
                try:
                    frame = channel.recv(timeout=1.0)
                except wire.RecvTimeout:
                    continue
                message = parse(frame, f"node {link.id}")
                if not isinstance(message, Done):
                    raise ProtocolError(f"node {link.id} sent {type(message).__name__}, which "
                                        f"only the service sends")
                self._scheduler.node_done(link, message.run, message.ok, message.detail)
        except MeshError as exc:
            log.info("node %s: %s", link.id if link else peer, exc)
        finally:
            channel.close()
            with self._lock:
                self._channels.discard(channel)
            if link is not None:
                self._scheduler.node_gone(link)
            self._slots.release()

    def _admit(self, channel: Any, peer: str) -> NodeLink | None:
        public = channel.peer_key
        problem = admission_problem(self._authorized(), public)
        if problem is not None:
            log.warning("refusing the node at %s: %s", peer, problem)
            send(channel, Refused(detail=problem))
            return None
        message = parse(channel.recv(timeout=self._timeout), f"the node at {peer}")
        if not isinstance(message, Hello):
            raise ProtocolError(f"the node at {peer} sent {type(message).__name__} before HELLO")
        caps = NodeCaps.from_json(message.caps, where=f"the node at {peer}: HELLO caps").to_json()
        node_id = wire.fingerprint(public) if public is not None else f"anonymous@{peer}"
        self._store.node_seen(node_id, public=None if public is None else
                              wire.public_key_text(public), caps=caps, address=peer)
        return NodeLink(id=node_id, public=public, channel=channel, caps=caps, address=peer)
