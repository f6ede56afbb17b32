"""Free TCP ports on 127.0.0.1 for tests that must name ports up front."""

from __future__ import annotations

import socket


def free_ports(n: int) -> list[int]:
    """n distinct free ports on 127.0.0.1 (bound together, then released for the test to bind)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
