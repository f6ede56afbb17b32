"""Connections held open without a word cost at most MAX_HANDSHAKES threads, and a node still joins."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
from meshkit_tcp.tcp import MAX_HANDSHAKES

from meshkit.node.config import NodeConfig

SECRET = b"handshake-cap-secret-0123456789"
HELD = MAX_HANDSHAKES * 2  # each displaced one is two lines of `refused` (MAX_REFUSED: 256)


def displaced(group) -> int:
    return sum("handshakes were in progress" in line for line in list(group.refused))


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_held_connections_are_capped_and_a_real_node_still_joins() -> None:
    coordinator = NodeConfig(rank=0, world=2, topology="star", bind="127.0.0.1:0",
                             secret=SECRET, timeout=30.0).connect()
    host, _, port = coordinator.address.rpartition(":")
    threads, fds = threading.active_count(), open_fds()
    held: list[socket.socket] = []
    try:
        for _ in range(HELD):
            held.append(socket.create_connection((host, int(port)), timeout=5))
        # Every connection past the cap displaced the oldest handshake, which
        # was refused (logged and counted): wait until all of them were.
        deadline = time.monotonic() + 20
        while displaced(coordinator) < HELD - MAX_HANDSHAKES:
            assert time.monotonic() < deadline, coordinator.refused[-3:]
            threading.Event().wait(0.05)
        assert displaced(coordinator) == HELD - MAX_HANDSHAKES
        assert threading.active_count() <= threads + MAX_HANDSHAKES + 1
        # Our end holds HELD descriptors; the coordinator's end at most the cap.
        assert open_fds() <= fds + HELD + MAX_HANDSHAKES + 2
        worker = NodeConfig(rank=1, world=2, peers=[coordinator.address], topology="star",
                            secret=SECRET, timeout=5.0).connect()
        try:
            assert coordinator.wait_for_workers(timeout=10) == [1]
        finally:
            worker.close()
    finally:
        for sock in held:
            sock.close()
        coordinator.close()
