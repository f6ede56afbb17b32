"""The tcp coordinator keeps admitting good ranks whatever a bad or unlucky one does."""

from __future__ import annotations

import errno
import os
import socket
import threading
import time

import pytest
from meshkit_tcp.sockets import MAX_HANDSHAKES

from meshkit import plugins, wire
from meshkit.errors import ConfigError, WireError
from meshkit.node.config import NodeConfig

SECRET = b"review-r1-secret-0123456789"


def _coordinator(world: int, timeout: float):
    return NodeConfig(rank=0, world=world, topology="star", bind="127.0.0.1:0", secret=SECRET,
                      timeout=timeout).connect()


def _address(group) -> tuple[str, int]:
    host, _, port = group.address.rpartition(":")
    return host, int(port)


def _read_hello(sock: socket.socket) -> bytes:
    got = b""
    for _ in range(wire.HELLO_SIZE):
        if len(got) == wire.HELLO_SIZE:
            break
        chunk = sock.recv(wire.HELLO_SIZE - len(got))
        if not chunk:
            break
        got += chunk
    return got


def assert_a_good_worker_still_joins(coordinator, via: str | None = None) -> None:
    """After whatever the test threw at it, the coordinator still admits rank 1 (dialing ``via``)."""
    worker = NodeConfig(rank=1, world=2, peers=[via or coordinator.address], topology="star",
                        secret=SECRET, timeout=5.0).connect()
    try:
        assert coordinator.wait_for_workers(timeout=10) == [1]
    finally:
        worker.close()


def test_closing_a_coordinator_does_not_wait_out_a_half_finished_handshake() -> None:
    # A peer that connected and stopped mid-handshake held close() for the
    # whole handshake timeout: closing the fd does not wake the thread
    # blocked reading it.
    coordinator = _coordinator(2, timeout=30.0)
    half = socket.create_connection(_address(coordinator), timeout=5)
    try:
        # The coordinator's hello proves its admit thread is inside the handshake.
        assert len(_read_hello(half)) == wire.HELLO_SIZE
        closer = threading.Thread(target=coordinator.close, daemon=True)
        closer.start()
        closer.join(5)
        assert not closer.is_alive(), "close() waited for the stalled handshake to time out"
    finally:
        half.close()
        coordinator.close()


def test_running_out_of_descriptors_in_accept_does_not_stop_ranks_joining_later(
        monkeypatch) -> None:
    # A connect flood that exhausts file descriptors made accept() fail with
    # EMFILE once, and the accept loop quit for good: no rank could ever join.
    coordinator = _coordinator(2, timeout=5.0)
    listener_fd = coordinator.links._listener.fileno()
    failed = threading.Event()
    real_accept = socket.socket.accept

    def accept(self):
        if not failed.is_set() and self.fileno() == listener_fd:
            failed.set()
            raise OSError(errno.EMFILE, "Too many open files")
        return real_accept(self)

    monkeypatch.setattr(socket.socket, "accept", accept)
    try:
        assert failed.wait(5), "the accept loop never called accept()"
        assert_a_good_worker_still_joins(coordinator)
    finally:
        coordinator.close()


def test_failing_to_start_a_handshake_thread_does_not_stop_ranks_joining_later() -> None:
    # Under a connect flood the accept loop may hit the thread limit; the
    # RuntimeError from Thread.start() escaped and ended the accept loop.
    coordinator = _coordinator(2, timeout=5.0)
    real_start = coordinator.links._spawn
    failed = threading.Event()

    def start(target, *args, name):
        if "admit" in name and not failed.is_set():
            failed.set()
            raise RuntimeError("can't start new thread")
        return real_start(target, *args, name=name)

    coordinator.links._spawn = start
    try:
        flood = socket.create_connection(_address(coordinator), timeout=5)
        try:
            assert failed.wait(5), "the accept loop never accepted the first connection"
            # The connection that could not get a thread is closed, not left hanging.
            assert flood.recv(1) == b""
        finally:
            flood.close()
        assert_a_good_worker_still_joins(coordinator)
    finally:
        coordinator.close()


def test_a_duplicate_rank_arriving_while_the_first_is_being_registered_is_refused() -> None:
    # The rank's reservation was released after the welcome was sent but
    # before the channel was registered: a second node claiming the same rank
    # in that window was welcomed too, and the two links then overwrote each
    # other in the routing table.
    coordinator = _coordinator(3, timeout=5.0)
    real_register = coordinator.links._register
    entered, release = threading.Event(), threading.Event()

    def register(rank, channel):
        if not entered.is_set():
            entered.set()
            release.wait(10)
        real_register(rank, channel)

    coordinator.links._register = register
    first = second = None
    try:
        first = NodeConfig(rank=1, world=3, peers=[coordinator.address], topology="star",
                           secret=SECRET, timeout=5.0).connect()
        assert entered.wait(5)
        with pytest.raises(WireError, match="duplicate rank"):
            second = NodeConfig(rank=1, world=3, peers=[coordinator.address],
                                topology="star", secret=SECRET, timeout=5.0).connect()
    finally:
        release.set()
        for group in (second, first):
            if group is not None:
                group.close()
        coordinator.close()


def test_the_refusal_log_of_a_long_lived_coordinator_stays_bounded() -> None:
    # Every refused connection (anyone may connect and hang up, no secret
    # needed) appended to group.refused for the life of the group: an
    # unauthenticated connect flood grew the coordinator's memory without end.
    coordinator = _coordinator(2, timeout=5.0)
    try:
        for i in range(5000):  # what 5,000 connect-and-hang-up peers leave behind
            coordinator.links._refuse(f"127.0.0.1:{i}", "closed the connection during the handshake")
        assert len(coordinator.refused) <= 1000
        assert coordinator.refused[-1].startswith("127.0.0.1:4999: ")
    finally:
        coordinator.close()


def test_a_bad_max_frame_is_refused_when_the_coordinator_starts() -> None:
    # max_frame_bytes = 0 let the coordinator start and then refuse every
    # worker inside the handshake, where the workers saw only a timeout.
    for bad in (0, -5, 1 << 64):
        with pytest.raises(ConfigError, match="max_frame_bytes"):
            NodeConfig(rank=0, world=2, topology="star", bind="127.0.0.1:0", secret=SECRET,
                       transport_options={"max_frame_bytes": bad}, timeout=5.0).connect()


#: Connections the flood holds open: each one displaced is two lines of
#: ``refused`` (its displacement, then its handshake's failure), under MAX_REFUSED.
HELD = MAX_HANDSHAKES * 2


def _displaced(group) -> int:
    return sum("handshakes were in progress" in line for line in list(group.refused))


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _hold(owner, address: str) -> list[socket.socket]:
    """HELD silent connections to ``address``, once ``owner`` displaced all it must."""
    host, _, port = address.rpartition(":")
    held = [socket.create_connection((host, int(port)), timeout=5) for _ in range(HELD)]
    # Every connection past the cap displaced the oldest handshake, which was
    # refused (logged and counted): wait until all of them were.
    deadline = time.monotonic() + 20
    while _displaced(owner) < HELD - MAX_HANDSHAKES:
        assert time.monotonic() < deadline, owner.refused[-3:]
        threading.Event().wait(0.05)
    assert _displaced(owner) == HELD - MAX_HANDSHAKES
    return held


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_held_connections_cost_at_most_max_handshakes_threads_and_a_real_node_still_joins(
        ) -> None:
    # 1,000 connections held open without a word took the coordinator to 583
    # threads: one thread and one descriptor per pending handshake.
    coordinator = _coordinator(2, timeout=30.0)
    threads, fds = threading.active_count(), _open_fds()
    held: list[socket.socket] = []
    try:
        held = _hold(coordinator, coordinator.address)

        # A displaced handshake's thread ends as soon as it sees its socket shut
        # down; without the cap every one would live out its 30 s timeout.
        def settled() -> bool:
            # Our end holds HELD descriptors; the coordinator's end at most the cap.
            return (threading.active_count() <= threads + MAX_HANDSHAKES + 1
                    and _open_fds() <= fds + HELD + MAX_HANDSHAKES + 2)

        deadline = time.monotonic() + 10
        while not settled() and time.monotonic() < deadline:
            threading.Event().wait(0.05)
        assert settled(), (threading.active_count() - threads, _open_fds() - fds)
        assert_a_good_worker_still_joins(coordinator)
    finally:
        for sock in held:
            sock.close()
        coordinator.close()


def test_a_host_relays_accept_loop_is_capped_the_same_way() -> None:
    coordinator = _coordinator(2, timeout=30.0)
    relay = plugins.create("transport", "tcp").start_relay(
        coordinator=coordinator.address, bind="127.0.0.1:0", world=2, ranks=(1,),
        secret=SECRET, name="hostA", timeout=30.0)
    held: list[socket.socket] = []
    try:
        held = _hold(relay, relay.address)
        assert_a_good_worker_still_joins(coordinator, via=relay.address)
    finally:
        for sock in held:
            sock.close()
        relay.close()
        coordinator.close()
