"""Authenticated channel pairs over real sockets on 127.0.0.1, and frames at the byte level."""

from __future__ import annotations

import select
import socket
from typing import Any

from meshkit import wire
from meshkit.testing.support import Call


SECRET = b"correct horse battery staple 123"


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """A connected pair of real TCP sockets on 127.0.0.1 (port 0)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(5)
        dialer = socket.create_connection(listener.getsockname(), timeout=5)
        accepted, _ = listener.accept()
    return dialer, accepted


def channel_pair(secret_a: bytes = SECRET, secret_b: bytes = SECRET, *, world_a: int = 2,
                 world_b: int = 2, timeout: float = 5.0, **kwargs: Any
                 ) -> tuple[wire.Channel, wire.Channel]:
    a, b = tcp_pair()
    other = Call(lambda: wire.handshake(b, secret_b, rank=1, world=world_b, timeout=timeout,
                                        **kwargs))
    first = wire.handshake(a, secret_a, rank=0, world=world_a, timeout=timeout, **kwargs)
    return first, other.result()


class Recorder:
    """Stands in for a channel's socket to capture the exact bytes of frames."""

    def __init__(self) -> None:
        self.data = bytearray()

    def send(self, view: Any) -> int:
        self.data += view
        return len(view)


def record(channel: wire.Channel, *frames: tuple[int, int, dict]) -> list[bytes]:
    """The wire bytes of each frame, as ``channel`` would send them next."""
    real = channel._sock
    out = []
    try:
        for kind, tag, state in frames:
            rec = Recorder()
            channel._sock = rec  # type: ignore[assignment]
            channel.send(kind, tag, state)
            out.append(bytes(rec.data))
    finally:
        channel._sock = real
    return out


def send_raw(channel: wire.Channel, data: bytes) -> None:
    """Write bytes straight to a channel's (non-blocking) socket, bypassing the codec."""
    sock = channel._sock
    view = memoryview(data)
    for _ in range(100_000):
        if not view:
            return
        if not select.select([], [sock], [], 5)[1]:
            break
        try:
            view = view[sock.send(view):]
        except BlockingIOError:
            continue
    raise AssertionError(f"could not write {len(view)} raw bytes: the peer is not reading")
