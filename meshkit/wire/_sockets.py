"""Socket plumbing the handshake and the channel share; no protocol logic here.

Closing so that a blocked reader wakes, TCP_NODELAY, the peer's address for
messages, reading an exact byte count under a whole-handshake deadline,
waiting for readiness with poll(), and asking the kernel how full a send
queue is.
"""

from __future__ import annotations

import select
import socket
import struct
import time
from typing import Any

from meshkit.errors import PeerLostError

try:  # how many bytes a socket's send queue holds (Linux: SIOCOUTQ == TIOCOUTQ)
    import fcntl
    import termios

    _OUTQ_REQUEST: int | None = termios.TIOCOUTQ
except (ImportError, AttributeError):  # pragma: no cover - not on Linux
    _OUTQ_REQUEST = None

_HAS_POLL = hasattr(select, "poll")
_MAX_POLL_MS = 2**31 - 1


def _configure(sock: socket.socket) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


def close_socket(sock: socket.socket) -> None:
    """Shut a socket down, then close it, ignoring errors.

    ``shutdown()`` first: closing the descriptor alone does not wake a thread
    blocked reading it (a handshake in progress would wait out its timeout).
    """
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


def _peer_address(sock: socket.socket) -> str:
    try:
        name = sock.getpeername()
    except OSError:
        return ""
    if isinstance(name, tuple) and len(name) >= 2:
        return f"{name[0]}:{name[1]}"
    return str(name) if name else ""


def _read_exact(sock: socket.socket, n: int, what: str, where: str, deadline: float) -> bytes:
    data = bytearray(n)
    view = memoryview(data)
    got = 0
    while got < n:
        # A deadline for the whole handshake, not per read: a peer dribbling
        # one byte at a time cannot hold the slot open for long.
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise socket.timeout
            sock.settimeout(remaining)
            k = sock.recv_into(view[got:], n - got)
        except socket.timeout:
            raise PeerLostError(f"{where} sent {got} of {n} bytes of its {what} and then "
                                "nothing until the handshake timeout; dropped") from None
        except OSError as exc:
            raise PeerLostError(f"{where} failed during the {what}: {exc}") from None
        if k == 0:
            raise PeerLostError(f"{where} closed the connection after {got} of {n} bytes of "
                                f"its {what}")
        got += k
    return bytes(data)


class _Poller:
    """Waits until a non-blocking socket is readable (or writable)."""

    def __init__(self, sock: socket.socket, *, write: bool = False) -> None:
        self._sock = sock
        self._write = write
        self._poll: Any = None
        if _HAS_POLL:
            self._poll = select.poll()
            self._poll.register(sock, select.POLLOUT if write else select.POLLIN | select.POLLPRI)

    def wait(self, timeout: float | None) -> bool:
        """True when ready (or in error: the next call reports it), False on timeout."""
        try:
            if self._poll is not None:
                # poll() takes at most 2**31 - 1 ms (24.8 days); a longer
                # timeout (1e9 s meaning "for ever") just polls that long.
                ms = None if timeout is None else int(min(max(timeout, 0.0) * 1000 + 0.999,
                                                          _MAX_POLL_MS))
                return bool(self._poll.poll(ms))
            if self._write:
                return bool(select.select([], [self._sock], [], timeout)[1])
            return bool(select.select([self._sock], [], [], timeout)[0])
        except (OSError, ValueError):
            return True  # a closed socket: let the read or write say what happened


def _send_queue_has_room(sock: socket.socket, nbytes: int) -> bool:
    """Whether the kernel takes ``nbytes`` more right now: the bytes already
    queued plus these fit in half the send buffer (the other half covers
    the kernel's per-packet overhead). False whenever it cannot tell."""
    if _OUTQ_REQUEST is None:
        return False
    try:
        queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), _OUTQ_REQUEST, b"\0\0\0\0"))[0]
        room = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 2
    except OSError:
        return False
    return queued + nbytes <= room
