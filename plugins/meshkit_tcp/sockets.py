"""How a TCP connection is addressed, made and accepted (no meshkit protocol here).

Rule: everything a listener or a dialer does before the wire handshake
lives here: parsing ``host:port``, binding, dialing with backoff, and the
accept loop that runs each handshake on its own thread, at most
:data:`MAX_HANDSHAKES` at once, so a connection that says nothing cannot
keep a real node out. :mod:`meshkit_tcp.links` and :mod:`meshkit_tcp.relay`
build on it.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from typing import Any, Callable

from meshkit.errors import ConfigError, MeshError, PeerLostError

__all__ = ["parse_address", "format_address", "listen", "dial", "accept_loop", "HandshakeSlots",
           "MAX_HANDSHAKES"]

log = logging.getLogger(__name__)

#: Accept-loop poll period: how quickly close() stops the listener.
_ACCEPT_POLL = 0.2
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
