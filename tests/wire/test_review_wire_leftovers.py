"""Regression tests from the adversarial review of the wire and transports (R1)
that protect other packages (the tcp transport, discovery, the reduce round,
node configuration), left here for the lead to move next to the code they
protect.

Each test pins one bug that was found and fixed: real sockets on 127.0.0.1,
port 0, synchronised on events and bounded joins (no sleeps).
"""

from __future__ import annotations

import errno
import math
import socket
import threading

import numpy as np
import pytest

from meshkit import plugins, wire
from meshkit.transport.discovery import DiscoveryServer, discover
from meshkit.errors import AggregationError, ConfigError, WireError
from meshkit.node.config import NodeConfig
from meshkit_tcp.testing import inproc_configs, run_ranks

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


def assert_a_good_worker_still_joins(coordinator) -> None:
    """After whatever the test threw at it, the coordinator still admits rank 1."""
    worker = NodeConfig(rank=1, world=2, peers=[coordinator.address], topology="star",
                        secret=SECRET, timeout=5.0).connect()
    try:
        assert coordinator.wait_for_workers(timeout=5) == [1]
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
    listener_fd = coordinator._listener.fileno()
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


def test_a_discovery_table_too_big_for_one_datagram_still_answers_star_workers() -> None:
    # The answer to a hello carried every known rank; past ~2,700 ranks it no
    # longer fit in a UDP datagram, sealing it raised inside the responder's
    # thread, and discovery died for every rank still to come.
    world = 5000
    with DiscoveryServer(SECRET, world, data_port=4000, host="127.0.0.1", port=0) as server:
        with server._cv:  # as if 3,000 workers had already said hello
            for rank in range(1, 3001):
                server._table[rank] = ("127.0.0.1", 4000 + rank, f"{rank:032x}")
        for rank in (3001, 3002):
            found = discover(SECRET, rank=rank, world=world, data_port=4000 + rank,
                             disc_port=server.port, via="127.0.0.1", timeout=3.0)
            assert found.peers[0] == "127.0.0.1:4000"


def test_failing_to_start_a_handshake_thread_does_not_stop_ranks_joining_later() -> None:
    # Under a connect flood the accept loop may hit the thread limit; the
    # RuntimeError from Thread.start() escaped and ended the accept loop.
    coordinator = _coordinator(2, timeout=5.0)
    real_start = coordinator._start
    failed = threading.Event()

    def start(target, *args, name):
        if target == coordinator._admit and not failed.is_set():
            failed.set()
            raise RuntimeError("can't start new thread")
        return real_start(target, *args, name=name)

    coordinator._start = start
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


def test_an_infinite_or_nan_node_timeout_is_a_config_error_not_an_overflow() -> None:
    # `meshkit node --timeout inf` reached the transport, where socket and
    # lock timeouts raised OverflowError (and NaN disabled every timeout).
    for bad in (math.inf, math.nan, 9.3e9, 1e300):
        with pytest.raises(ConfigError, match=r"timeout must be a number of seconds > 0 and "
                                              r"at most 1e\+09"):
            NodeConfig(rank=0, world=2, topology="star", bind="127.0.0.1:0", secret=SECRET,
                       timeout=bad)


def test_a_duplicate_rank_arriving_while_the_first_is_being_registered_is_refused() -> None:
    # The rank's reservation was released after the welcome was sent but
    # before the channel was registered: a second node claiming the same rank
    # in that window was welcomed too, and the two links then overwrote each
    # other in the routing table.
    coordinator = _coordinator(3, timeout=5.0)
    real_register = coordinator._register
    entered, release = threading.Event(), threading.Event()

    def register(rank, channel):
        if not entered.is_set():
            entered.set()
            release.wait(10)
        real_register(rank, channel)

    coordinator._register = register
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


def test_a_worker_whose_contribution_could_not_be_encoded_can_retry_the_same_round() -> None:
    # all_reduce counted the round before sending: a payload the wire refused
    # (nothing sent) still moved the worker on a round, so its corrected retry
    # arrived as "round 1" and the coordinator declared it dead.

    configs = inproc_configs(2, timeout=5.0)
    coordinator = configs[0].connect()
    try:
        def worker(group):
            with pytest.raises(WireError):
                group.all_reduce({"w": np.array([1 + 2j])})  # complex: not a wire dtype
            return group.all_reduce({"w": np.array([2.0])})

        ranks = run_ranks(configs[1:], worker)
        coordinator.wait_for_workers(timeout=5)
        result = coordinator.reduce_round(plugins.create("aggregator", "fedavg"))
        scattered = ranks.join()
    finally:
        coordinator.close()
    assert result.contributors == [1] and result.dead == []
    # The ledger is the whole ledger after the round: a worker that got its
    # scatter may already have left, but nobody was dropped for a protocol fault.
    assert all("left the mesh" in why for why in result.ledger.values()), result.ledger
    np.testing.assert_allclose(scattered[1]["w"], [2.0])


def test_a_coordinator_contribution_the_aggregator_refuses_aborts_the_round_for_workers() -> None:
    # The coordinator's own contribution was folded outside the abort guard:
    # when the aggregator refused it, the workers were never told and waited
    # out their whole timeout for a scatter that could not come.

    configs = inproc_configs(2, timeout=30.0)
    coordinator = configs[0].connect()
    fedavg = plugins.create("aggregator", "fedavg")
    try:
        def worker(group):
            with pytest.raises(AggregationError, match="refused reduce round 0"):
                group.all_reduce({"w": np.ones(2)}, timeout=5.0)
            return group.all_reduce({"w": np.full(2, 3.0)}, timeout=5.0)

        ranks = run_ranks(configs[1:], worker)
        coordinator.wait_for_workers(timeout=5)
        with pytest.raises(AggregationError, match="finite"):  # e.g. 0 examples / 0
            coordinator.reduce_round(fedavg, contribution={"w": np.ones(2)},
                                     weight=float("nan"))
        result = coordinator.reduce_round(fedavg, contribution={"w": np.full(2, 1.0)})
        scattered = ranks.join()
    finally:
        coordinator.close()
    assert result.round == 1 and sorted(result.contributors) == [0, 1]
    np.testing.assert_allclose(scattered[1]["w"], [2.0, 2.0])


def test_a_deeply_nested_discovery_datagram_is_ignored_not_fatal_to_the_responder() -> None:
    # json.loads raises RecursionError (not ValueError) on deep nesting; it
    # escaped the responder's thread and discovery stopped answering anyone.
    with DiscoveryServer(SECRET, 2, data_port=4000, host="127.0.0.1", port=0) as server:
        deep = wire.seal_datagram(SECRET, b"[" * 20_000 + b"]" * 20_000)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.sendto(deep, ("127.0.0.1", server.port))
        found = discover(SECRET, rank=1, world=2, data_port=4001, disc_port=server.port,
                         via="127.0.0.1", timeout=3.0)
        assert found.peers[0] == "127.0.0.1:4000"
        assert server.ignored == 1


def test_a_str_secret_is_refused_when_the_node_is_configured() -> None:
    # A coordinator given a str secret started fine and then refused every
    # worker at the handshake (the workers only saw the connection close);
    # the inproc transport raised a bare TypeError comparing it.
    with pytest.raises(ConfigError, match="secret must be bytes"):
        NodeConfig(rank=0, world=2, topology="star", bind="127.0.0.1:0",
                   secret=SECRET.decode())


def test_a_bad_max_frame_is_refused_when_the_coordinator_starts() -> None:
    # max_frame_bytes = 0 let the coordinator start and then refuse every
    # worker inside the handshake, where the workers saw only a timeout.
    for bad in (0, -5, 1 << 64):
        with pytest.raises(ConfigError, match="max_frame_bytes"):
            NodeConfig(rank=0, world=2, topology="star", bind="127.0.0.1:0", secret=SECRET,
                       transport_options={"max_frame_bytes": bad}, timeout=5.0).connect()


def test_the_refusal_log_of_a_long_lived_coordinator_stays_bounded() -> None:
    # Every refused connection (anyone may connect and hang up, no secret
    # needed) appended to group.refused for the life of the group: an
    # unauthenticated connect flood grew the coordinator's memory without end.
    coordinator = _coordinator(2, timeout=5.0)
    try:
        for i in range(5000):  # what 5,000 connect-and-hang-up peers leave behind
            coordinator._refuse(f"127.0.0.1:{i}", "closed the connection during the handshake")
        assert len(coordinator.refused) <= 1000
        assert coordinator.refused[-1].startswith("127.0.0.1:4999: ")
    finally:
        coordinator.close()
