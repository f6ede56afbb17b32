"""The tcp host relay in one process: who it carries, what it forwards, and what it refuses.

A coordinator, a relay (threads) carrying ranks 1 and 2, and rank 3 dialing
the coordinator directly. Bad connections at the relay (wrong secret,
garbage, a rank it does not carry) get a specific error while the ranks
that behave carry on; deaths travel both ways.
"""

from __future__ import annotations

import contextlib
import socket
import threading

import numpy as np
import pytest

from meshkit import AuthenticationError, WireError, plugins, wire
from meshkit.node.config import NodeConfig
from meshkit.transport import TAG_RELAY_CTL
from meshkit_tcp.joining import KIND_CONTROL, ROLE_STAR

SECRET = b"host-relay-test-secret"
TAG = 7


def coordinator(world: int = 4, timeout: float = 5.0):
    return NodeConfig(rank=0, world=world, topology="star", bind="127.0.0.1:0", secret=SECRET,
                      timeout=timeout).connect()


def start_relay(address: str, ranks=(1, 2), *, world: int = 4, secret: bytes = SECRET,
                name: str = "hostA"):
    transport = plugins.create("transport", "tcp")
    return transport.start_relay(coordinator=address, bind="127.0.0.1:0", world=world,
                                 ranks=ranks, secret=secret, name=name, timeout=5.0)


def worker(rank: int, peer: str, *, world: int = 4, secret: bytes = SECRET):
    return NodeConfig(rank=rank, world=world, topology="star", peers=(peer,), secret=secret,
                      timeout=5.0).connect()


def wait_until(lock, predicate, timeout: float = 5.0) -> bool:
    """Wait on a group's or relay's own condition (notified on every change); bounded."""
    with lock:
        return lock.wait_for(predicate, timeout)


@pytest.fixture
def mesh():
    """Coordinator, relay carrying 1 and 2, both joined through it, rank 3 direct."""
    group = coordinator()
    relay = start_relay(group.address)
    ranks = {1: worker(1, relay.address), 2: worker(2, relay.address),
             3: worker(3, group.address)}
    try:
        assert group.wait_for_workers(timeout=5) == [1, 2, 3]
        yield group, relay, ranks
    finally:
        for g in ranks.values():
            g.close()
        relay.close()
        group.close()


def test_ranks_behind_a_relay_join_and_talk_through_its_one_connection(mesh):
    group, relay, ranks = mesh
    assert group.relays == {"hostA": [1, 2]}
    # The coordinator to a rank behind the relay, and back.
    group.send(1, TAG, {"x": 1})
    assert ranks[1].recv(0, TAG) == {"x": 1}
    ranks[2].send(0, TAG, {"y": 2})
    assert group.recv(2, TAG) == {"y": 2}
    # Worker to worker: from behind the relay to a direct rank, and across it.
    ranks[1].send(3, TAG, {"z": 3})
    assert ranks[3].recv(1, TAG) == {"z": 3}
    ranks[3].send(2, TAG, {"w": 4})
    assert ranks[2].recv(3, TAG) == {"w": 4}
    assert (relay.frames_up, relay.frames_down) == (2, 2)


def test_a_death_the_coordinator_declares_reaches_the_owning_relay(mesh):
    group, relay, ranks = mesh
    group.declare_dead(1, "the strategy gave up on it")
    assert wait_until(relay._lock, lambda: 1 in relay.dead)
    assert "the strategy gave up on it" in relay.dead[1]
    # Its neighbour behind the same relay is untouched.
    group.send(2, TAG, {"still": True})
    assert ranks[2].recv(0, TAG) == {"still": True}
    assert group.relays == {"hostA": [2]}


def test_a_relay_that_goes_takes_exactly_its_ranks(mesh):
    group, relay, ranks = mesh
    relay.close()
    assert wait_until(group.links._lock, lambda: sorted(group.dead) == [1, 2])
    dead = group.dead
    assert group.relays == {}
    assert sorted(dead) == [1, 2]
    assert all("host relay 'hostA'" in why for why in dead.values())
    group.send(3, TAG, {"alive": 1})
    assert ranks[3].recv(0, TAG) == {"alive": 1}


def test_wrong_secret_garbage_and_foreign_ranks_are_refused_at_the_relay(mesh):
    group, relay, ranks = mesh
    with pytest.raises(AuthenticationError, match="wrong secret"):
        worker(2, relay.address, secret=b"not-the-right-secret!")
    host, port = relay.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(80))
        assert wait_until(relay._lock, lambda: any("not a meshkit node" in r
                                                   for r in relay.refused))
    with pytest.raises(WireError, match=r"carries ranks \[1, 2\], not rank 3"):
        worker(3, relay.address)
    # The worker raises as soon as it sees the relay's proof fail; the relay records its own
    # refusal on its admit thread, which under load can come later: wait for it (bounded).
    assert wait_until(relay._lock, lambda: any("failed authentication" in r or "wrong secret" in r
                                               for r in relay.refused), timeout=60.0)
    # The relay and the coordinator keep serving the ranks that behave.
    group.send(1, TAG, {"ok": 1})
    assert ranks[1].recv(0, TAG) == {"ok": 1}
    assert group.dead == {} and group.relays == {"hostA": [1, 2]}


def test_a_relay_with_the_wrong_secret_is_refused_and_the_coordinator_keeps_serving():
    group = coordinator(world=3)
    try:
        with pytest.raises(AuthenticationError, match="wrong secret"):
            start_relay(group.address, ranks=(1,), world=3, secret=b"a-wrong-relay-secret")
        assert wait_until(group.links._lock, lambda: bool(group.refused))
        direct = worker(1, group.address, world=3)
        try:
            # The worker returns once welcomed, maybe before rank 0 recorded the
            # link: a frame from it arrives only after that.
            direct.send(0, TAG, {"hello": 1})
            assert group.recv(1, TAG, timeout=5) == {"hello": 1}
            group.send(1, TAG, {"ok": 1})
            assert direct.recv(0, TAG) == {"ok": 1}
        finally:
            direct.close()
    finally:
        group.close()


def test_the_coordinator_refuses_a_relay_announcing_taken_or_invalid_ranks(mesh):
    group, relay, ranks = mesh
    with pytest.raises(WireError, match="relay 'hostB' announced rank 3, which is already "
                                        "connected"):
        start_relay(group.address, ranks=(3,), name="hostB")
    with pytest.raises(WireError, match="a host relay named 'hostA' is already connected"):
        start_relay(group.address, ranks=(3,), name="hostA")
    assert group.dead == {}


def test_a_rank_may_not_forge_the_relays_own_news(mesh):
    group, relay, ranks = mesh
    with pytest.raises(ValueError, match="transport's"):
        ranks[1].send(0, TAG_RELAY_CTL, {"op": "lost", "rank": 2})


def test_a_rank_sending_the_relays_own_frames_is_dropped_and_the_others_carry_on():
    group = coordinator(world=3)
    relay = start_relay(group.address, ranks=(1, 2), world=3)
    good = worker(1, relay.address, world=3)
    try:
        host, port = relay.address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=5)
        forger = wire.handshake(sock, SECRET, rank=2, world=3, role=ROLE_STAR, timeout=5.0)
        assert forger.recv(timeout=5).state["ok"] is True
        # A forged "rank 1 was lost", in the relay's own control tag.
        forger.send(KIND_CONTROL, TAG_RELAY_CTL, {"op": "lost", "rank": 1, "reason": "forged"})
        assert wait_until(group.links._lock, lambda: 2 in group.dead)
        assert "host relay's own frame" in group.dead[2] and "protocol violation" in group.dead[2]
        forger.close()
        group.send(1, TAG, {"ok": 1})
        assert good.recv(0, TAG) == {"ok": 1}
        assert 1 not in group.dead
    finally:
        good.close()
        relay.close()
        group.close()


def test_a_relay_with_authorized_nodes_admits_listed_keys_only(tmp_path):
    public = {name: wire.generate_node_key(tmp_path / name) for name in ("one", "other")}
    keys = {name: wire.load_node_key(tmp_path / name) for name in public}
    listed = tmp_path / "authorized"
    listed.write_text(wire.public_key_text(public["one"]) + " rank=1\n")
    group = coordinator()
    transport = plugins.create("transport", "tcp")
    relay = transport.start_relay(
        coordinator=group.address, bind="127.0.0.1:0", world=4, ranks=(1, 2), secret=SECRET,
        name="hostA", timeout=5.0, authorized_nodes=wire.load_authorized_nodes(listed))
    joined = []
    try:
        joined.append(NodeConfig(rank=1, world=4, topology="star", peers=(relay.address,),
                                 secret=SECRET, timeout=5.0, node_key=keys["one"]).connect())
        for key, fragment in ((None, "no node key"),
                              (keys["other"], "is unknown"),
                              (keys["one"], "is bound to rank 1")):
            with pytest.raises(WireError, match="checks node keys") as info:
                NodeConfig(rank=2, world=4, topology="star", peers=(relay.address,),
                           secret=SECRET, timeout=5.0, node_key=key).connect()
            assert fragment in str(info.value)
        assert wait_until(relay._lock, lambda: len(relay.refused) == 3)
        # Rank 1 is through; rank 3 (direct) is not the relay's business.
        joined.append(worker(3, group.address))
        assert wait_until(group.links._lock, lambda: {1, 3} <= set(group.joined))
    finally:
        for g in joined:
            g.close()
        relay.close()
        group.close()


def test_a_rank_that_stops_reading_does_not_hold_up_its_neighbours_frames():
    group = coordinator(world=3, timeout=10.0)
    relay = start_relay(group.address, ranks=(1, 2), world=3)
    good = worker(2, relay.address, world=3)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    host, port = relay.address.rsplit(":", 1)
    sock.connect((host, int(port)))
    stalled = wire.handshake(sock, SECRET, rank=1, world=3, role=ROLE_STAR, timeout=10.0)
    try:
        assert stalled.recv(timeout=5).state["ok"] is True
        assert group.wait_for_workers(timeout=5) == [1, 2]
        # Rank 1 reads nothing more: its frames fill the socket buffers and its
        # writer at the relay blocks. Rank 2's frame, sent after them, must
        # still reach it while rank 1 is not yet declared lost (before, the
        # relay wrote every frame on its one upstream reader, so rank 2's
        # waited for rank 1's write timeout).
        big = {"x": np.zeros(1 << 20, np.float32)}
        for _ in range(3):
            group.send(1, TAG, big)
        group.send(2, TAG, {"y": 2})
        assert good.recv(0, TAG, timeout=8) == {"y": 2}
        assert 1 not in relay.dead and 1 not in group.dead
    finally:
        stalled.close()
        good.close()
        relay.close()
        group.close()


def test_ranks_a_lost_relay_announced_but_never_joined_are_not_dead_and_join_another():
    with contextlib.ExitStack() as stack:
        group = coordinator(world=3)
        stack.callback(group.close)
        relay = start_relay(group.address, name="hostA", world=3)
        stack.callback(relay.close)
        assert wait_until(group.links._lock, lambda: "hostA" in group.links._relays)
        relay.close()  # before any of its ranks joined
        assert wait_until(group.links._lock, lambda: "hostA" not in group.links._relays)
        assert group.dead == {}
        # The same relay again (a new port): its ranks join through it.
        again = start_relay(group.address, name="hostA", world=3)
        stack.callback(again.close)
        for rank in (1, 2):
            stack.callback(worker(rank, again.address, world=3).close)
        assert group.wait_for_workers(timeout=5) == [1, 2]
        assert group.relays == {"hostA": [1, 2]} and group.dead == {}


def test_the_relay_delivers_what_the_coordinator_sent_before_its_goodbye(mesh):
    group, relay, ranks = mesh
    for i in range(20):
        group.send(1, TAG, {"i": i, "x": np.zeros(1 << 16, np.float32)})
    group.close()  # its goodbye follows the frames at once
    assert [ranks[1].recv(0, TAG)["i"] for _ in range(20)] == list(range(20))
    assert relay.serve(timeout=10).stopped == "the coordinator ended the run"
