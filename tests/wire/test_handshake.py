"""The hello exchange (``meshkit.wire._handshake``) over real sockets on 127.0.0.1."""

from __future__ import annotations

import socket
import struct
import threading

import numpy as np
import pytest

from meshkit import wire
from meshkit.errors import AuthenticationError, ConfigError, PeerLostError, WireError
from meshkit.testing.support import Call

from tests.support.channels import SECRET, channel_pair, tcp_pair


def _hello(version: int = wire.PROTOCOL_VERSION, rank: int = 1, world: int = 2) -> bytes:
    return struct.pack("<8sHHHHIIQ16s32s", b"MESHKIT\x00", version, 0, 0, 0, rank, world,
                       wire.DEFAULT_MAX_FRAME, bytes(16), bytes(range(32)))


# ----------------------------------------------------------------------------- refusals


def test_a_wrong_secret_is_an_authentication_error_on_both_ends():
    a, b = tcp_pair()
    other = Call(lambda: wire.handshake(b, b"another secret, not ours", rank=1, world=2))
    with pytest.raises(AuthenticationError, match="wrong secret"):
        wire.handshake(a, SECRET, rank=0, world=2)
    with pytest.raises(AuthenticationError, match="wrong secret") as info:
        other.result()
    assert SECRET.decode() not in str(info.value)


def test_a_world_size_mismatch_names_both_sizes_on_both_ends():
    a, b = tcp_pair()
    other = Call(lambda: wire.handshake(b, SECRET, rank=1, world=3))
    with pytest.raises(WireError, match="world of 3.*world of 4"):
        wire.handshake(a, SECRET, rank=0, world=4)
    with pytest.raises(WireError, match="world of 4.*world of 3"):
        other.result()


def test_a_protocol_version_mismatch_names_both_versions():
    a, b = tcp_pair()
    b.sendall(_hello(version=9))
    with pytest.raises(WireError, match=f"version 9.*version {wire.PROTOCOL_VERSION}"):
        wire.handshake(a, SECRET, rank=0, world=2)
    b.close()


def test_a_peer_that_is_not_meshkit_is_refused_by_its_first_bytes():
    a, b = tcp_pair()
    b.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(60))
    with pytest.raises(WireError, match="not a meshkit node"):
        wire.handshake(a, SECRET, rank=0, world=2)
    b.close()


def test_a_reflected_hello_is_refused():
    a, b = tcp_pair()
    reflector = Call(lambda: b.sendall(b.recv(wire.HELLO_SIZE)))
    with pytest.raises(AuthenticationError, match="reflection"):
        wire.handshake(a, SECRET, rank=0, world=2, timeout=2)
    reflector.result()
    b.close()


def test_different_jobs_refuse_each_other():
    a, b = tcp_pair()
    other = Call(lambda: wire.handshake(b, SECRET, rank=1, world=2, session=b"job-b"))
    with pytest.raises(WireError, match="job"):
        wire.handshake(a, SECRET, rank=0, world=2, session=b"job-a")
    with pytest.raises(WireError):
        other.result()


def test_a_handshake_refused_for_its_arguments_still_closes_the_socket() -> None:
    # The docstring promises the socket is closed on every error; argument
    # errors were raised before the guard, leaving the peer waiting.
    for kwargs in ({"secret": None}, {"max_frame": 0}, {"rank": 2}, {"session": b"x" * 17}):
        a, b = socket.socketpair()
        try:
            args = {"secret": SECRET, "rank": 0, "world": 2, **kwargs}
            with pytest.raises(ConfigError):
                wire.handshake(a, args.pop("secret"), **args)
            assert a.fileno() == -1, kwargs
        finally:
            a.close()
            b.close()


# ----------------------------------------------------------------------------- what a peer announces


def test_the_handshake_carries_rank_world_role_and_session():
    a, b = channel_pair(session=b"job-7", role=3)
    assert (a.peer.rank, a.peer.world, a.peer.role, a.peer.session) == (1, 2, 3, b"job-7")
    assert (b.peer.rank, b.peer.world) == (0, 2)
    assert a.peer.address.startswith("127.0.0.1:")
    a.close(), b.close()


# ----------------------------------------------------------------------------- deadlines


def test_a_peer_that_connects_and_sends_nothing_times_out_in_the_handshake():
    a, b = tcp_pair()
    with pytest.raises(PeerLostError, match="handshake timeout"):
        wire.handshake(a, SECRET, rank=0, world=2, timeout=0.2)
    b.close()


def test_a_peer_dribbling_its_handshake_is_dropped_at_the_handshake_deadline():
    a, b = tcp_pair()
    stop = threading.Event()

    def dribble() -> None:
        for byte in _hello() + bytes(32):
            if stop.wait(0.02):  # pacing of a misbehaving peer, not synchronisation
                return
            b.sendall(bytes([byte]))

    dribbler = Call(dribble)
    with pytest.raises(PeerLostError, match="handshake timeout"):
        wire.handshake(a, SECRET, rank=0, world=2, timeout=5, handshake_timeout=0.3)
    stop.set()
    try:
        dribbler.result()
    except OSError:
        pass  # our end hung up on it mid-dribble
    b.close()


# ----------------------------------------------------------------------------- frame MACs are on unless both ends turn them off for a benchmark


def test_frame_macs_can_be_disabled_only_on_both_ends_for_benchmarks():
    a, b = channel_pair(benchmark_only_disable_mac=True)
    a.send(1, 1, {"x": np.arange(3)})
    np.testing.assert_array_equal(b.recv().state["x"], np.arange(3))
    assert not a.mac_enabled
    a.close(), b.close()

    x, y = tcp_pair()
    other = Call(lambda: wire.handshake(y, SECRET, rank=1, world=2))
    with pytest.raises(WireError, match="MACs may only be disabled on both ends"):
        wire.handshake(x, SECRET, rank=0, world=2, benchmark_only_disable_mac=True)
    with pytest.raises(WireError, match="MACs may only be disabled"):
        other.result()


def test_no_configuration_option_can_turn_frame_macs_off():
    import attrs

    from meshkit import plugins
    from meshkit.node.config import NodeConfig

    names = [f.name for f in attrs.fields(NodeConfig)]
    for component in plugins.available("transport").values():
        if component.options is not None:
            names += [f.name for f in attrs.fields(component.options)]
    assert not [n for n in names if "mac" in n.lower() or "auth" in n.lower()
                and n != "authorized_nodes"], names
