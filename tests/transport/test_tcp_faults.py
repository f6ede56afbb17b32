"""Faults over real sockets: refused handshakes, stalled and lying peers, a killed worker.

In every test the coordinator keeps serving the ranks that behave: their
round (each worker's state up, the weighted mean back, over ``send``/``recv``)
completes while the bad connection is refused or declared dead.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest

from meshkit import AuthenticationError, PeerLostError, WireError, wire
from meshkit.node.config import NodeConfig
from meshkit.transport import ANY, _forwarding
from meshkit_tcp.testing import run_ranks, tcp_star_configs

SECRET = b"tcp-fault-secret"


def star_coordinator(world: int, timeout: float = 5.0):
    return NodeConfig(rank=0, world=world, topology="star", bind="127.0.0.1:0", secret=SECRET,
                      timeout=timeout).connect()


def wait_until(group, predicate, timeout: float = 5.0) -> bool:
    """Wait on the tcp group's own condition (no sleeps) for a bounded time.

    It is notified when a connection is refused, a link comes up or a link
    is dropped (a rank declared dead).
    """
    with group.links._lock:
        return group.links._lock.wait_for(predicate, timeout)


#: The round's two tags: a worker's state up, the mean back.
TAG_UP, TAG_DOWN = 21, 22


def contribute(group):
    """A worker's share of a round: its state (weight = its rank) up, the mean back."""
    group.send(0, TAG_UP, {"w": np.full(16, float(group.rank), np.float32)})
    return group.recv(0, TAG_DOWN)


class Round:
    """Who contributed to a round, and who the coordinator's ledger holds dead after it."""

    def __init__(self, contributors, dead) -> None:
        self.contributors, self.dead = contributors, dead


def gather_round(coordinator, ranks=None, timeout: float = 5.0) -> Round:
    """Rank 0's side: the state of each of ``ranks`` (default: the live workers), then
    their weighted mean back to each.

    A rank declared dead meanwhile is no longer waited for (the ledger is read
    between bounded receives, so a death ends the wait for it).
    """
    expected = set(coordinator.live_ranks if ranks is None else ranks)
    states: dict = {}
    deadline = time.monotonic() + timeout
    while (expected - set(states) - set(coordinator.dead)) and time.monotonic() < deadline:
        try:
            src, state = coordinator.recv(ANY, TAG_UP, timeout=0.1)
        except PeerLostError:
            continue  # nothing yet, or a death: read the ledger again
        states[src] = state
    # Read before the mean goes back: a worker that has it leaves (a goodbye).
    dead = sorted(coordinator.dead)
    weights = {r: float(r) for r in states}
    mean = sum(weights[r] * states[r]["w"] for r in states) / sum(weights.values())
    for rank in states:
        coordinator.send(rank, TAG_DOWN, {"w": mean.astype(np.float32)})
    return Round(sorted(states), dead)


def weighted_mean(ranks) -> float:
    return sum(r * r for r in ranks) / sum(ranks)


def run_round_with(coordinator, world: int, bad):
    """Start the good workers, run ``bad()`` once they joined, then one round."""
    ranks = run_ranks(tcp_star_configs(world, coordinator.address, secret=SECRET), contribute)
    coordinator.wait_for_workers(timeout=5)
    outcome = bad()
    result = gather_round(coordinator)
    return outcome, result, ranks.join()


def test_a_worker_with_the_wrong_secret_is_refused_and_the_others_complete() -> None:
    coordinator = star_coordinator(4)
    try:
        def impostor():
            bad = NodeConfig(rank=2, world=4, peers=[coordinator.address], topology="star",
                             secret=b"a different secret", timeout=2)
            with pytest.raises(AuthenticationError, match="wrong secret"):
                bad.connect()

        _, result, scattered = run_round_with(coordinator, 4, impostor)
        assert wait_until(coordinator, lambda: coordinator.refused)
    finally:
        coordinator.close()
    assert "wrong secret" in coordinator.refused[0]
    assert sorted(result.contributors) == [1, 2, 3] and result.dead == []
    for state in scattered.values():
        np.testing.assert_allclose(state["w"], weighted_mean([1, 2, 3]), rtol=1e-6)


def test_a_worker_with_another_world_size_is_told_both_sizes() -> None:
    coordinator = star_coordinator(3)
    try:
        def wrong_world():
            bad = NodeConfig(rank=1, world=5, peers=[coordinator.address], topology="star",
                             secret=SECRET, timeout=2)
            with pytest.raises(WireError, match="world of 3.*world of 5"):
                bad.connect()

        _, result, _ = run_round_with(coordinator, 3, wrong_world)
        assert wait_until(coordinator, lambda: coordinator.refused)
    finally:
        coordinator.close()
    assert "world of 5" in coordinator.refused[0] and "world of 3" in coordinator.refused[0]
    assert sorted(result.contributors) == [1, 2]


def test_a_second_connection_claiming_a_live_rank_is_refused_as_a_duplicate() -> None:
    coordinator = star_coordinator(3)
    try:
        def duplicate():
            again = tcp_star_configs(3, coordinator.address, secret=SECRET)[0]
            with pytest.raises(WireError, match="refused rank 1: rank 1 is already connected.*"
                                                "duplicate rank"):
                again.connect()

        _, result, scattered = run_round_with(coordinator, 3, duplicate)
    finally:
        coordinator.close()
    assert "duplicate rank" in coordinator.refused[0]
    assert sorted(result.contributors) == [1, 2]
    np.testing.assert_allclose(scattered[1]["w"], weighted_mean([1, 2]), rtol=1e-6)


def _hello(version: int, rank: int, world: int) -> bytes:
    return wire._HELLO.pack(wire.HELLO_MAGIC, version, 0, 0, 0, rank, world,
                            wire.DEFAULT_MAX_FRAME, bytes(16), os.urandom(32))


def test_a_peer_speaking_another_protocol_version_is_refused_by_the_coordinator() -> None:
    coordinator = star_coordinator(3)
    try:
        def old_peer():
            with socket.create_connection(_address(coordinator), timeout=5) as sock:
                sock.sendall(_hello(wire.PROTOCOL_VERSION + 98, 1, 3))
                assert wait_until(coordinator, lambda: coordinator.refused)

        _, result, _ = run_round_with(coordinator, 3, old_peer)
    finally:
        coordinator.close()
    message = coordinator.refused[0]
    assert f"version {wire.PROTOCOL_VERSION + 98}" in message
    assert f"version {wire.PROTOCOL_VERSION}" in message
    assert sorted(result.contributors) == [1, 2]


def test_a_worker_dialing_a_node_of_another_version_names_both_versions() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def fake_coordinator():
        conn, _ = server.accept()
        with conn:
            conn.sendall(_hello(wire.PROTOCOL_VERSION + 1, 0, 2))
            conn.recv(4096)

    thread = threading.Thread(target=fake_coordinator, daemon=True)
    thread.start()
    try:
        config = NodeConfig(rank=1, world=2, peers=[f"127.0.0.1:{port}"], topology="star",
                            secret=SECRET, timeout=2)
        with pytest.raises(WireError, match=f"version {wire.PROTOCOL_VERSION + 1}.*"
                                            f"version {wire.PROTOCOL_VERSION}"):
            config.connect()
    finally:
        thread.join(5)
        server.close()


def _address(group) -> tuple[str, int]:
    host, _, port = group.address.rpartition(":")
    return host, int(port)


def test_a_peer_that_connects_and_sends_nothing_is_dropped_after_the_timeout() -> None:
    coordinator = star_coordinator(3, timeout=0.5)
    silent = socket.create_connection(_address(coordinator), timeout=5)
    try:
        _, result, _ = run_round_with(coordinator, 3, lambda: None)
        assert sorted(result.contributors) == [1, 2]
        assert wait_until(coordinator, lambda: coordinator.refused, timeout=5)
    finally:
        silent.close()
        coordinator.close()
    assert "handshake" in coordinator.refused[0]


class _StallingSocket:
    """Passes ``limit`` bytes of sends through, then stalls until released."""

    def __init__(self, sock: socket.socket, limit: int, release: threading.Event) -> None:
        self._sock = sock
        self._left = limit
        self._release = release
        self.stalled = threading.Event()

    def send(self, data) -> int:
        if self._left <= 0:
            self.stalled.set()
            self._release.wait(30)
            raise OSError("released by the test")
        n = self._sock.send(memoryview(data)[: self._left])
        self._left -= n
        return n

    def __getattr__(self, name):
        return getattr(self._sock, name)


def test_a_worker_that_stops_mid_frame_is_declared_dead_and_the_round_completes() -> None:
    coordinator = star_coordinator(4, timeout=0.5)
    release = threading.Event()
    staller = NodeConfig(rank=3, world=4, peers=[coordinator.address], topology="star",
                         secret=SECRET, timeout=0.5).connect()
    try:
        channel = staller.links._channels[0]
        stalling = _StallingSocket(channel._sock, wire.HEADER_SIZE + 1000, release)
        channel._sock = stalling
        thread = threading.Thread(
            target=lambda: pytest.raises(Exception, staller.send, 0, TAG_UP,
                                         {"w": np.ones(1 << 18, np.float32)}),
            daemon=True)
        thread.start()
        assert stalling.stalled.wait(5)
        good = run_ranks(tcp_star_configs(4, coordinator.address, secret=SECRET)[:2], contribute)
        assert wait_until(coordinator, lambda: 3 in coordinator.dead)
        result = gather_round(coordinator, [1, 2])
        scattered = good.join()
        ledger = coordinator.dead
    finally:
        release.set()
        staller.close()
        coordinator.close()
    assert sorted(result.contributors) == [1, 2]
    assert result.dead == [3]
    assert "stalled" in ledger[3]
    np.testing.assert_allclose(scattered[1]["w"], weighted_mean([1, 2]), rtol=1e-6)


def test_a_worker_sending_a_forged_frame_is_declared_dead() -> None:
    coordinator = star_coordinator(4)
    forger = NodeConfig(rank=3, world=4, peers=[coordinator.address], topology="star",
                        secret=SECRET, timeout=5).connect()
    try:
        channel = forger.links._channels[0]
        channel._sock.sendall(b"MKF\x01" + os.urandom(wire.HEADER_SIZE - 4))
        good = run_ranks(tcp_star_configs(4, coordinator.address, secret=SECRET)[:2], contribute)
        assert wait_until(coordinator, lambda: 3 in coordinator.dead)
        result = gather_round(coordinator, [1, 2])
        good.join()
        ledger = coordinator.dead
    finally:
        forger.close()
        coordinator.close()
    assert sorted(result.contributors) == [1, 2]
    assert "failed authentication" in ledger[3]


class _UnreadSocket:
    """A receiving end that stops reading (its process hung): reads block until released."""

    def __init__(self, sock: socket.socket, release: threading.Event) -> None:
        self._sock = sock
        self._release = release

    def recv_into(self, *args, **kwargs):
        self._release.wait(30)
        raise OSError("released by the test")

    def __getattr__(self, name):
        return getattr(self._sock, name)


@pytest.mark.parametrize("queue, reason", [
    (None, "took no data for 3.0 s"),  # the relay writer's stall timeout
    (2, "took none of the 2 message(s)"),  # its queue stayed full for half of it
])
def test_a_destination_that_stops_reading_does_not_hold_up_relays_to_other_ranks(
        monkeypatch, queue, reason) -> None:
    """Rank 1 floods rank 2, which has stopped reading, then writes to rank 3. The
    coordinator relays to each destination on its own, so rank 3 gets its message
    long before rank 2 is declared dead, and rank 1's link is never at risk."""
    if queue is not None:
        monkeypatch.setattr(_forwarding, "RELAY_QUEUE", queue)
    coordinator = star_coordinator(4, timeout=3.0)
    release = threading.Event()
    workers = [NodeConfig(rank=r, world=4, peers=[coordinator.address], topology="star",
                          secret=SECRET, timeout=3.0).connect() for r in (1, 2, 3)]
    one, two, three = workers
    try:
        assert coordinator.wait_for_workers(timeout=5) == [1, 2, 3]
        channel = two.links._channels[0]
        # Small socket buffers, so the kernel cannot swallow the flood below.
        channel._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        coordinator.links._channels[2]._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
        channel._sock = _UnreadSocket(channel._sock, release)
        for i in range(8):
            one.send(2, 7, {"x": np.full(1 << 20, i, np.float32)})
        one.send(3, 8, {"hello": "from rank 1"})
        # All eight fit the default queue, so nothing waits; with a queue of two,
        # rank 1's reader waits for room until rank 2 is declared dead.
        assert three.recv(1, 8, timeout=1.5 if queue is None else 5.0) == {
            "hello": "from rank 1"}
        assert wait_until(coordinator, lambda: 2 in coordinator.dead, timeout=15)
        assert reason in coordinator.dead[2]
        assert 1 not in coordinator.dead and 3 not in coordinator.dead
        assert 0 not in one.dead
        one.send(3, 9, {"still": "relayed"})
        assert three.recv(1, 9, timeout=5.0) == {"still": "relayed"}
    finally:
        release.set()
        for group in (*workers, coordinator):
            group.close()
