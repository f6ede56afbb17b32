"""The tcp transport over real sockets on 127.0.0.1: star and full mesh, 4 ranks."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from meshkit import ConfigError, PeerLostError, WireError
from meshkit.node.config import NodeConfig
from meshkit.transport import ANY
from meshkit_tcp.sockets import parse_address
from meshkit_tcp.testing import run_ranks, tcp_star_configs

from meshkit.train import free_ports
SECRET = b"tcp-test-secret-0123"



def star_coordinator(world: int, timeout: float = 5.0, **kw):
    return NodeConfig(rank=0, world=world, topology="star", bind="127.0.0.1:0", secret=SECRET,
                      timeout=timeout, **kw).connect()


def test_a_star_of_four_ranks_carries_states_to_rank_0_and_relays_worker_to_worker() -> None:
    coordinator = star_coordinator(4)
    try:
        host, port = parse_address(coordinator.address)
        assert host == "127.0.0.1" and port > 0

        def worker(group):
            group.send(0, 10, {"w": np.full((3, 2), float(group.rank), np.float32),
                               "step": {"n": group.rank}})
            # Worker-to-worker through the coordinator (nothing dials a worker).
            nxt = 1 + group.rank % 3
            group.send(nxt, 11, {"from": group.rank, "a": np.arange(4, dtype=np.int16)})
            prev = 3 if group.rank == 1 else group.rank - 1
            got = group.recv(prev, 11)
            group.send(0, 12, {"done": group.rank})
            return got

        ranks = run_ranks(tcp_star_configs(4, coordinator.address, secret=SECRET), worker)
        assert coordinator.wait_for_workers(timeout=5) == [1, 2, 3]
        states = dict(coordinator.recv(ANY, 10) for _ in range(3))
        done = sorted(coordinator.recv(ANY, 12)[0] for _ in range(3))
        results = ranks.join()
    finally:
        coordinator.close()
    assert sorted(states) == [1, 2, 3] and done == [1, 2, 3]
    for rank, state in states.items():
        assert state["w"].dtype == np.float32 and state["step"] == {"n": rank}
        np.testing.assert_array_equal(state["w"], np.full((3, 2), float(rank), np.float32))
    for rank, got in results.items():
        assert got["from"] == (3 if rank == 1 else rank - 1)
        np.testing.assert_array_equal(got["a"], np.arange(4, dtype=np.int16))


def test_a_full_mesh_of_four_ranks_connects_every_pair_and_reduces() -> None:
    ports = free_ports(4)
    peers = [f"127.0.0.1:{p}" for p in ports]
    configs = [NodeConfig(rank=r, world=4, peers=peers, topology="mesh", secret=SECRET,
                          timeout=5) for r in range(4)]

    def rank(group):
        for dst in range(4):
            if dst != group.rank:
                group.send(dst, 3, {"from": group.rank})
        got = sorted(group.recv(src, 3)["from"] for src in range(4) if src != group.rank)
        return got, group.mesh_all_reduce({"x": np.full(2, 3.0 * group.rank)})

    results = run_ranks(configs, rank).join()
    assert sorted(results) == [0, 1, 2, 3]
    for r, (got, mean) in results.items():
        assert got == [s for s in range(4) if s != r]
        np.testing.assert_allclose(mean["x"], (0 + 3 + 6 + 9) / 4)


def test_a_worker_with_no_coordinator_gives_up_after_its_timeout() -> None:
    (port,) = free_ports(1)
    config = NodeConfig(rank=1, world=2, peers=[f"127.0.0.1:{port}"], topology="star",
                        secret=SECRET, timeout=0.5)
    with pytest.raises(PeerLostError, match="could not reach rank 0 at 127.0.0.1"):
        config.connect()


def test_a_coordinator_needs_an_address_and_a_secret() -> None:
    with pytest.raises(ConfigError, match="bind"):
        NodeConfig(rank=0, world=2, topology="star", secret=SECRET).connect()
    with pytest.raises(ConfigError, match="no secret"):
        NodeConfig(rank=0, world=2, topology="star", bind="127.0.0.1:0").connect()
    with pytest.raises(ConfigError, match="host:port"):
        parse_address("nonsense")


def test_a_star_worker_dialing_a_mesh_rank_is_told_the_topologies_differ() -> None:
    ports = free_ports(2)
    peers = [f"127.0.0.1:{p}" for p in ports]
    mesh0 = NodeConfig(rank=0, world=2, peers=peers, topology="mesh", secret=SECRET, timeout=2)
    errors: dict = {}

    def run_mesh0():
        try:
            mesh0.connect().close()
        except Exception as exc:  # the mesh never completes: its peer was refused
            errors["mesh0"] = exc

    thread = threading.Thread(target=run_mesh0)
    thread.start()
    star1 = NodeConfig(rank=1, world=2, peers=[peers[0]], topology="star", secret=SECRET,
                       timeout=2)
    with pytest.raises(WireError, match="refused rank 1: rank 1 runs a star topology, "
                                        "rank 0 a mesh"):
        star1.connect()
    thread.join(10)
    assert isinstance(errors.get("mesh0"), PeerLostError)


def test_declare_dead_drops_the_rank_and_tells_observers() -> None:
    coordinator = star_coordinator(2)
    seen = []
    coordinator.on_dead = lambda rank, why: seen.append((rank, why))
    worker = tcp_star_configs(2, coordinator.address, secret=SECRET)[0].connect()
    try:
        coordinator.wait_for_workers(timeout=5)
        coordinator.declare_dead(1, "heartbeat missed")
        assert seen == [(1, "heartbeat missed")]
        assert coordinator.live_ranks == [] and coordinator.dead == {1: "heartbeat missed"}
        with pytest.raises(PeerLostError, match="rank 0"):
            worker.recv(0, 1, timeout=5)  # the worker sees its link go
    finally:
        worker.close()
        coordinator.close()


def test_a_relayed_message_waits_at_the_coordinator_for_a_late_worker() -> None:
    coordinator = star_coordinator(3)
    configs = tcp_star_configs(3, coordinator.address, secret=SECRET)
    early = configs[0].connect()
    try:
        early.send(2, 4, {"x": np.arange(5, dtype=np.float32)})
        late = configs[1].connect()
        try:
            got = late.recv(1, 4, timeout=5)
        finally:
            late.close()
    finally:
        early.close()
        coordinator.close()
    np.testing.assert_array_equal(got["x"], np.arange(5, dtype=np.float32))


def test_relayed_messages_keep_their_order_per_sender_when_inline_and_queued_writes_mix(
        ) -> None:
    """Every worker sends every other one a stream of small and 2 MiB messages at
    once; small socket buffers make the coordinator switch between writing a relay
    on the spot and queueing it for the destination's writer. Each destination
    must still get each sender's stream whole and in order."""
    world, count = 4, 24
    coordinator = star_coordinator(world, timeout=10.0)
    workers = [NodeConfig(rank=r, world=world, peers=[coordinator.address], topology="star",
                          secret=SECRET, timeout=10.0).connect() for r in range(1, world)]
    try:
        assert coordinator.wait_for_workers(timeout=5) == [1, 2, 3]
        for r in range(1, world):
            coordinator.links._channels[r]._sock.setsockopt(socket.SOL_SOCKET,
                                                             socket.SO_SNDBUF, 1 << 17)
        outcomes: list[bool] = []  # the coordinator's inline attempts: sent, or queued
        relay_now = coordinator.links.relay_now

        def counting_relay_now(peer, message) -> bool:
            sent = relay_now(peer, message)
            outcomes.append(sent)
            return sent

        coordinator.links.relay_now = counting_relay_now

        def size(i: int) -> int:
            return (1 << 19) if i % 3 == 2 else 16  # float32 elements: 2 MiB or 64 bytes

        def send_all(group) -> None:
            for i in range(count):
                for dst in range(1, world):
                    if dst != group.rank:
                        group.send(dst, 5, {"i": i, "x": np.full(size(i), group.rank,
                                                                    np.float32)})

        senders = [threading.Thread(target=send_all, args=(g,), daemon=True) for g in workers]
        for t in senders:
            t.start()
        got: dict[tuple[int, int], list[int]] = {}
        for group in workers:
            for src in range(1, world):
                if src == group.rank:
                    continue
                seen = got.setdefault((src, group.rank), [])
                for _ in range(count):
                    msg = group.recv(src, 5, timeout=20)
                    assert msg["x"].shape == (size(msg["i"]),) and msg["x"][0] == src
                    seen.append(msg["i"])
        for t in senders:
            t.join(20)
            assert not t.is_alive()
        assert coordinator.dead == {}
    finally:
        for group in (*workers, coordinator):
            group.close()
    assert len(got) == 6 and got == {pair: list(range(count)) for pair in got}
    # Both paths ran: relays written on the spot, and relays handed to a writer
    # (an inline attempt that found no room, or none tried while one was queued).
    relayed = 6 * count
    assert any(outcomes) and (outcomes.count(True) < relayed)
