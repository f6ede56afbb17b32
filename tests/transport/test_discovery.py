"""UDP discovery on 127.0.0.1: unicast rendezvous, refusals, foreign datagrams ignored."""

from __future__ import annotations

import json
import os
import socket
import threading

import numpy as np
import pytest

from meshkit import PeerLostError, WireError, plugins, wire
from meshkit.transport import ANY
from meshkit.transport.discovery import VERSION, DiscoveryServer, discover
from meshkit.node.config import NodeConfig

SECRET = b"discovery-secret"


@pytest.fixture
def server():
    with DiscoveryServer(SECRET, 3, data_port=4000, host="127.0.0.1", port=0) as srv:
        yield srv


def ask(server, rank, *, world=3, secret=SECRET, want_all=False, timeout=3.0, port=None):
    return discover(secret, rank=rank, world=world, data_port=port or 4000 + rank,
                    disc_port=server.port, via="127.0.0.1", want_all=want_all, timeout=timeout)


def test_a_worker_finds_the_coordinator_by_unicast_to_a_rendezvous_host(server) -> None:
    result = ask(server, 1)
    assert result.peers[0] == "127.0.0.1:4000"
    assert server.table()[1] == "127.0.0.1:4001"


def test_mesh_ranks_wait_for_the_complete_table(server) -> None:
    results = {}
    threads = [threading.Thread(target=lambda r=r: results.setdefault(r, ask(server, r,
                                                                           want_all=True)))
               for r in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    expected = {0: "127.0.0.1:4000", 1: "127.0.0.1:4001", 2: "127.0.0.1:4002"}
    assert results[1].peers == expected and results[2].peers == expected
    assert server.wait_complete(1) == {0: ":4000", 1: "127.0.0.1:4001", 2: "127.0.0.1:4002"}


def test_a_duplicate_rank_is_refused_naming_the_rank(server) -> None:
    ask(server, 1)
    with pytest.raises(WireError, match="rank 1 is already held .*duplicate rank"):
        ask(server, 1, port=5001)
    assert "duplicate rank" in server.refused[0]


def test_a_world_size_mismatch_names_both_sizes(server) -> None:
    with pytest.raises(WireError, match="world of 4.*world of 3"):
        ask(server, 1, world=4)


def test_foreign_forged_and_malformed_datagrams_are_ignored_and_counted(server) -> None:
    junk = [
        os.urandom(40),                                            # random bytes
        wire.seal_datagram(b"another secret 0123", b'{"v":1,"t":"hello"}'),  # foreign key
        wire.seal_datagram(SECRET, b"not json"),                   # malformed body
        wire.seal_datagram(SECRET, b'{"v":99,"t":"hello"}'),        # unknown version
        wire.seal_datagram(SECRET, b'{"v":1,"t":"hello","rank":"1"}'),  # wrong field types
    ]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for datagram in junk:
            sock.sendto(datagram, ("127.0.0.1", server.port))
    # The server still answers a good hello (after the junk: UDP keeps order on loopback).
    assert ask(server, 2).peers[0] == "127.0.0.1:4000"
    assert server.ignored == len(junk)
    assert 1 not in server.table()


def test_a_worker_with_the_wrong_secret_gets_no_answer(server) -> None:
    with pytest.raises(PeerLostError) as info:
        ask(server, 1, secret=b"wrong secret 0123456", timeout=0.5)
    # What was tried, for how long, and what to check.
    message = str(info.value)
    assert "rank 1 tried for" in message and "hello(s) by unicast to 127.0.0.1:" in message
    assert "nothing answered" in message and "same shared secret" in message
    assert server.ignored >= 1 and 1 not in server.table()


def free_port(kind=socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_tcp_star_formed_by_discovery_runs_a_round() -> None:
    disc_port, data_base = free_port(socket.SOCK_DGRAM), free_port()
    common = dict(world=3, topology="star", discover=True, disc_port=disc_port,
                  data_base=data_base, via="127.0.0.1", secret=SECRET, timeout=5)
    coordinator = NodeConfig(rank=0, **common).connect()
    results = {}
    try:
        def worker(rank):
            group = NodeConfig(rank=rank, **common).connect()
            try:
                group.send(0, 5, {"x": np.full(2, float(rank))})
                results[rank] = group.recv(0, 6)
            finally:
                group.close()

        threads = [threading.Thread(target=worker, args=(r,)) for r in (1, 2)]
        for thread in threads:
            thread.start()
        got = dict(coordinator.recv(ANY, 5) for _ in range(2))
        mean = (got[1]["x"] + got[2]["x"]) / 2
        for rank in got:
            coordinator.send(rank, 6, {"x": mean})
        for thread in threads:
            thread.join(10)
    finally:
        coordinator.close()
    assert sorted(got) == [1, 2]
    np.testing.assert_allclose(results[1]["x"], 1.5)


def test_broadcast_discovery_when_the_network_allows_it() -> None:
    try:
        srv = DiscoveryServer(SECRET, 2, data_port=4000, host="0.0.0.0", port=0)
    except Exception as exc:  # pragma: no cover - sandbox dependent
        pytest.skip(f"cannot bind a UDP socket on 0.0.0.0: {exc}")
    with srv:
        try:
            result = discover(SECRET, rank=1, world=2, data_port=4001, disc_port=srv.port,
                              timeout=1.0)
        except PeerLostError as exc:
            pytest.skip(f"UDP broadcast does not reach this host's own socket here: {exc}")
    assert result.peers[0].endswith(":4000")


def _hello(rank: int, *, nonce: str, session: str | None = None, world: int = 3,
           port: int = 4001) -> bytes:
    body = {"v": VERSION, "t": "hello", "rank": rank, "world": world, "port": port,
            "nonce": nonce}
    if session is not None:
        body["session"] = session
    return wire.seal_datagram(SECRET, json.dumps(body).encode())


def _exchange(sock: socket.socket, datagram: bytes, port: int) -> dict | None:
    """Send one datagram to the server and read its sealed answer (None: no answer)."""
    sock.sendto(datagram, ("127.0.0.1", port))
    try:
        reply, _ = sock.recvfrom(65535)
    except TimeoutError:
        return None
    return json.loads(wire.open_datagram(SECRET, reply))


def test_a_hello_from_an_earlier_run_is_challenged_and_registers_nothing(server) -> None:
    # A hello captured in another run carries that run's session (or none).
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(2)
        for stale in (_hello(1, nonce="ab" * 16, session="cd" * 16),
                      _hello(1, nonce="ab" * 16)):
            answer = _exchange(sock, stale, server.port)
            assert answer == {"v": VERSION, "t": "challenge", "nonce": "ab" * 16,
                              "session": server.session}
    assert 1 not in server.table()
    # So the real rank 1 is not refused as a duplicate.
    assert ask(server, 1).peers[0] == "127.0.0.1:4000"
    assert server.table()[1] == "127.0.0.1:4001"


def test_this_runs_hello_replayed_from_another_host_is_ignored(server) -> None:
    hello = _hello(1, nonce="ef" * 16, session=server.session)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as first:
        first.bind(("127.0.0.1", 0))
        first.settimeout(2)
        assert _exchange(first, hello, server.port)["t"] == "table"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as other:
        other.bind(("127.0.0.2", 0))  # another host on the loopback network
        other.settimeout(0.5)
        assert _exchange(other, hello, server.port) is None  # no table to a spoofed source
    assert server.table()[1] == "127.0.0.1:4001"
    assert server.ignored == 1


def test_a_server_restart_draws_a_new_session() -> None:
    with DiscoveryServer(SECRET, 2, data_port=4000, host="127.0.0.1", port=0) as one, \
            DiscoveryServer(SECRET, 2, data_port=4000, host="127.0.0.1", port=0) as two:
        assert one.session != two.session and len(one.session) == 32
