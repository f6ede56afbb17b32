"""Faults over real sockets: refused handshakes, stalled and lying peers, a killed worker.

In every test the coordinator keeps serving the ranks that behave: their
round completes while the bad connection is refused or declared dead.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from meshkit import AuthenticationError, WireError, plugins, wire
from meshkit.aggregation import begin
from meshkit.node.config import NodeConfig
from meshkit.transport import _forwarding, _reduce
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


def contribute(group):
    return group.all_reduce({"w": np.full(16, float(group.rank), np.float32)},
                            weight=float(group.rank))


def weighted_mean(ranks) -> float:
    return sum(r * r for r in ranks) / sum(ranks)


def run_round_with(coordinator, world: int, bad):
    """Start the good workers, run ``bad()`` once they joined, then one round."""
    ranks = run_ranks(tcp_star_configs(world, coordinator.address, secret=SECRET), contribute)
    coordinator.wait_for_workers(timeout=5)
    outcome = bad()
    result = coordinator.reduce_round(plugins.create("aggregator", "fedavg"))
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
            target=lambda: pytest.raises(Exception, staller.all_reduce,
                                         {"w": np.ones(1 << 18, np.float32)}),
            daemon=True)
        thread.start()
        assert stalling.stalled.wait(5)
        good = run_ranks(tcp_star_configs(4, coordinator.address, secret=SECRET)[:2], contribute)
        result = coordinator.reduce_round(plugins.create("aggregator", "fedavg"), timeout=5)
        scattered = good.join()
    finally:
        release.set()
        staller.close()
        coordinator.close()
    assert sorted(result.contributors) == [1, 2]
    assert result.dead == [3]
    assert "stalled" in result.ledger[3]
    np.testing.assert_allclose(scattered[1]["w"], weighted_mean([1, 2]), rtol=1e-6)


class _TricklingSocket:
    """Hands the reader 4 KiB per read, 10 ms apart: slow, but never stalled."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._pace = threading.Event()  # never set: wait() is a bounded pause

    def recv_into(self, buffer, nbytes=0, *args):
        self._pace.wait(0.01)
        return self._sock.recv_into(buffer, min(nbytes or len(buffer), 4096), *args)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def test_a_lone_worker_reading_the_scatter_too_slowly_is_cut_off_at_the_deadline(
        monkeypatch) -> None:
    """With one rank to scatter to, the write runs on the coordinator's thread:
    the transport must end it at the scatter's deadline, not the stall timeout."""
    # Budget: the 0.5 s stall timeout + 4 MiB at 4 MiB/s = 1.5 s; reading
    # 4 MiB at about 400 KB/s would take 10 s.
    monkeypatch.setattr(_reduce, "MIN_SCATTER_BYTES_PER_SECOND", 4 << 20)
    coordinator = star_coordinator(2, timeout=0.5)
    worker = NodeConfig(rank=1, world=2, peers=[coordinator.address], topology="star",
                        secret=SECRET, timeout=0.5).connect()
    failed = threading.Event()

    def slow_worker() -> None:
        with pytest.raises(Exception):
            worker.all_reduce({"w": np.ones(1 << 20, np.float32)}, timeout=20)
        failed.set()

    try:
        assert coordinator.wait_for_workers(timeout=5) == [1]
        # Small socket buffers, so the kernel cannot swallow the whole scatter.
        coordinator.links._channels[1]._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
        channel = worker.links._channels[0]
        channel._sock = _TricklingSocket(channel._sock)
        thread = threading.Thread(target=slow_worker, daemon=True)
        thread.start()
        result = coordinator.reduce_round(plugins.create("aggregator", "fedavg"),
                                          contribution={"w": np.ones(1 << 20, np.float32)},
                                          timeout=10)
        assert failed.wait(20)
    finally:
        worker.close()
        coordinator.close()
    assert result.contributors == [0, 1]
    assert result.dead == [1]
    assert "deadline passed" in result.ledger[1] and "reads too slowly" in result.ledger[1]


def test_a_worker_sending_a_forged_frame_is_declared_dead() -> None:
    coordinator = star_coordinator(4)
    forger = NodeConfig(rank=3, world=4, peers=[coordinator.address], topology="star",
                        secret=SECRET, timeout=5).connect()
    try:
        channel = forger.links._channels[0]
        channel._sock.sendall(b"MKF\x01" + os.urandom(wire.HEADER_SIZE - 4))
        good = run_ranks(tcp_star_configs(4, coordinator.address, secret=SECRET)[:2], contribute)
        result = coordinator.reduce_round(plugins.create("aggregator", "fedavg"))
        good.join()
    finally:
        forger.close()
        coordinator.close()
    assert sorted(result.contributors) == [1, 2]
    assert "failed authentication" in result.ledger[3]


_KILLED_WORKER = textwrap.dedent("""
    import math, sys
    from meshkit.node.config import NodeConfig
    address, secret = sys.argv[1], sys.argv[2].encode()
    group = NodeConfig(rank=4, world=5, peers=[address], topology="star", secret=secret,
                       timeout=30).connect()
    print("joined", flush=True)
    group.recv(0, 99, timeout=math.inf)  # never answered: killed while the round runs
""")


@pytest.mark.slow
def test_killing_one_of_four_workers_mid_round_leaves_the_weighted_mean_of_the_other_three(
        ) -> None:
    coordinator = star_coordinator(5, timeout=20)
    process = subprocess.Popen([sys.executable, "-c", _KILLED_WORKER, coordinator.address,
                                SECRET.decode()], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "joined"
        folded = threading.Event()

        class SignalAfterThree:
            """fedavg, plus an event once three contributions are in the fold."""

            def __init__(self) -> None:
                self.inner = plugins.create("aggregator", "fedavg")

            def begin(self):
                fold = begin(self.inner)
                count = [0]

                class Fold:
                    def add(self, state, weight=1.0, *, source=None):
                        fold.add(state, weight, source=source)
                        count[0] += 1
                        if count[0] == 3:
                            folded.set()

                    def result(self):
                        return fold.result()

                return Fold()

        good = run_ranks(tcp_star_configs(5, coordinator.address, secret=SECRET)[:3], contribute)
        assert coordinator.wait_for_workers(timeout=10) == [1, 2, 3, 4]
        outcome: dict = {}
        round_thread = threading.Thread(target=lambda: outcome.setdefault(
            "result", coordinator.reduce_round(SignalAfterThree())))
        round_thread.start()
        assert folded.wait(10)  # mid-round: three folded, rank 4 still owes its share
        process.send_signal(signal.SIGKILL)
        round_thread.join(15)
        scattered = good.join()
    finally:
        process.kill()
        process.wait(10)
        coordinator.close()
    result = outcome["result"]
    assert sorted(result.contributors) == [1, 2, 3]
    assert result.dead == [4] and 4 in coordinator.dead
    for state in scattered.values():
        np.testing.assert_allclose(state["w"], weighted_mean([1, 2, 3]), rtol=1e-6)
    np.testing.assert_allclose(result.consensus["w"], weighted_mean([1, 2, 3]), rtol=1e-6)


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
