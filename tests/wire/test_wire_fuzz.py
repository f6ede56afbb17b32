"""Hypothesis fuzzing of the wire decoder, the frame reader and the handshake.

Whatever bytes arrive, the only outcomes are a decoded state or a
``WireError`` (``AuthenticationError`` is one); a truncated stream is a
``PeerLostError``. No other exception escapes, and nothing is allocated
beyond what the bytes actually present justify.
"""

from __future__ import annotations

import socket
import struct
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshkit import wire
from meshkit.errors import AuthenticationError, PeerLostError, WireError
from meshkit.testing.support import Call

from tests.support.channels import SECRET, channel_pair, record, send_raw
FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
FEW = settings(max_examples=40, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _body(state: dict, bf16: bool = False) -> bytes:
    encoded = wire.encode_state(state, bf16=bf16)
    return bytes(bytearray().join(memoryview(b).cast("B") for b in encoded.buffers))


SAMPLE = _body({
    "w": np.arange(24, dtype=np.float32).reshape(2, 3, 4),
    "b": np.array([True, False]),
    "h": np.ones(3, ml_dtypes.bfloat16),
    "i": np.arange(5, dtype=np.int64),
    "meta": {"round": 1, "names": ["a", "b"], "x": None},
})
SAMPLE_BF16 = _body({"w": np.arange(8, dtype=np.float32), "k": 3}, bf16=True)


def _decode_within_bound(data: bytes, flags: int = 0) -> None:
    """Decode; the only allowed failure is WireError; allocations stay bounded."""
    buf = np.frombuffer(bytearray(data), dtype=np.uint8)
    tracemalloc.start()
    try:
        try:
            wire.decode_state(buf, flags=flags)
        except WireError:
            pass
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Views cost nothing; JSON parsing and the bf16 widening are bounded by a
    # small multiple of the bytes present, never by a size the bytes claim.
    assert peak <= 64 * len(data) + (256 << 10), f"{peak} bytes allocated for {len(data)}"


@FUZZ
@given(st.binary(max_size=4096))
def test_random_bytes_decode_or_raise_wire_error(data):
    _decode_within_bound(data)


@FUZZ
@given(st.data())
def test_truncated_bodies_raise_wire_error(data):
    sample = data.draw(st.sampled_from([SAMPLE, SAMPLE_BF16]))
    cut = data.draw(st.integers(0, len(sample) - 1))
    with pytest.raises(WireError):
        wire.decode_state(np.frombuffer(bytearray(sample[:cut]), np.uint8))


@FUZZ
@given(st.data())
def test_bit_flipped_bodies_decode_or_raise_wire_error(data):
    sample = bytearray(data.draw(st.sampled_from([SAMPLE, SAMPLE_BF16])))
    for _ in range(data.draw(st.integers(1, 8))):
        pos = data.draw(st.integers(0, len(sample) - 1))
        sample[pos] ^= 1 << data.draw(st.integers(0, 7))
    flags = wire.FLAG_BF16 if data.draw(st.booleans()) else 0
    _decode_within_bound(bytes(sample), flags)


@FUZZ
@given(
    count=st.integers(0, 2 ** 32 - 1),
    kind=st.integers(0, 255),
    code=st.integers(0, 255),
    ndim=st.integers(0, 255),
    eflags=st.integers(0, 255),
    name_len=st.integers(0, 2 ** 32 - 1),
    data_len=st.integers(0, 2 ** 64 - 1),
    dims=st.lists(st.integers(0, 2 ** 64 - 1), max_size=8),
    tail=st.binary(max_size=256),
)
def test_hostile_table_fields_are_bounded_before_use(count, kind, code, ndim, eflags, name_len,
                                                     data_len, dims, tail):
    data = (struct.pack("<II", count, 0) + struct.pack("<BBBBIQ", kind, code, ndim, eflags,
                                                       name_len, data_len)
            + b"".join(struct.pack("<Q", d) for d in dims) + tail)
    _decode_within_bound(data)


# ----------------------------------------------------------------------------- the stream


@FEW
@given(st.binary(min_size=wire.HEADER_SIZE, max_size=2048))
def test_random_bytes_on_a_channel_are_an_authentication_error(data):
    a, b = channel_pair(timeout=2)
    try:
        send_raw(a, data)
        tracemalloc.start()
        try:
            with pytest.raises(AuthenticationError):
                b.recv()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 256 << 10
    finally:
        a.close(), b.close()


@FEW
@given(st.data())
def test_bit_flips_anywhere_in_a_frame_are_an_authentication_error(data):
    a, b = channel_pair(timeout=2)
    try:
        (frame,) = record(a, (1, 3, {"x": np.arange(100, dtype=np.float64), "m": {"k": [1]}}))
        flipped = bytearray(frame)
        pos = data.draw(st.integers(0, len(frame) - 1))
        flipped[pos] ^= 1 << data.draw(st.integers(0, 7))
        send_raw(a, bytes(flipped))
        # The header MAC is checked before its length is trusted, so even a
        # flipped length field never leaves the reader waiting for bytes.
        with pytest.raises(AuthenticationError):
            b.recv()
    finally:
        a.close(), b.close()


@FEW
@given(st.data())
def test_a_truncated_frame_stream_is_a_lost_peer(data):
    a, b = channel_pair(timeout=2)
    try:
        (frame,) = record(a, (1, 3, {"x": np.arange(100, dtype=np.float64)}))
        cut = data.draw(st.integers(0, len(frame) - 1))
        send_raw(a, frame[:cut])
        a._sock.shutdown(socket.SHUT_WR)
        with pytest.raises(PeerLostError, match="closed the connection"):
            b.recv()
    finally:
        a.close(), b.close()


@FEW
@given(st.binary(min_size=0, max_size=200))
def test_garbage_in_the_handshake_is_a_wire_error_or_a_lost_peer(data):
    x, y = socket.socketpair()
    try:
        y.sendall(data)
        y.shutdown(socket.SHUT_WR)
        with pytest.raises((WireError, PeerLostError)):
            wire.handshake(x, SECRET, rank=0, world=2, timeout=2)
    finally:
        y.close()


def _pump(src: socket.socket, dst: socket.socket, flip_at: int = -1, bit: int = 0) -> None:
    """Relay bytes src -> dst until EOF, flipping one bit of the stream."""
    seen = 0
    while True:
        try:
            chunk = bytearray(src.recv(4096))
        except OSError:
            chunk = bytearray()
        if not chunk:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            return
        if seen <= flip_at < seen + len(chunk):
            chunk[flip_at - seen] ^= 1 << bit
        seen += len(chunk)
        try:
            dst.sendall(chunk)
        except OSError:
            return


@FEW
@given(st.integers(0, wire.HELLO_SIZE + wire.MAC_SIZE - 1), st.integers(0, 7))
def test_a_bit_flip_in_the_handshake_is_refused_by_the_end_that_hears_it(pos, bit):
    # x <-> [y | tampering relay | peer_side] <-> honest; x's bytes get a flip.
    x, y = socket.socketpair()
    honest_sock, peer_side = socket.socketpair()
    honest = Call(lambda: wire.handshake(honest_sock, SECRET, rank=1, world=2, timeout=5))
    there = Call(lambda: _pump(y, peer_side, pos, bit))
    back = Call(lambda: _pump(peer_side, y))
    try:
        mine = Call(lambda: wire.handshake(x, SECRET, rank=0, world=2, timeout=5))
        with pytest.raises((WireError, PeerLostError)):
            honest.result()
        if pos < wire.HELLO_SIZE:
            # A changed hello changes both transcripts: neither end authenticates.
            with pytest.raises((WireError, PeerLostError)):
                mine.result()
        else:
            # Only x's confirmation was hit: x heard a valid one and proceeds,
            # but the honest end refused and hung up, so x's first recv fails.
            channel = mine.result()
            with pytest.raises(PeerLostError):
                channel.recv(timeout=5)
        there.result(), back.result()
    finally:
        for s in (x, y, honest_sock, peer_side):
            s.close()


@pytest.mark.parametrize("dims", [(0, 2 ** 63), (0, 2 ** 64 - 1), (2 ** 40, 0, 2 ** 40)])
def test_zero_sized_arrays_with_absurd_dimensions_are_a_wire_error(dims):
    name = b"z"
    data = (struct.pack("<II", 1, 0) + struct.pack("<BBBBIQ", 1, 12, len(dims), 0, 1, 0)
            + b"".join(struct.pack("<Q", d) for d in dims) + name)
    data += bytes(-len(data) % 64)
    with pytest.raises(WireError, match="not a valid array shape"):
        wire.decode_state(np.frombuffer(bytearray(data), np.uint8))


@FUZZ
@given(st.lists(st.integers(0, 2 ** 64 - 1), min_size=1, max_size=6),
       st.sampled_from(sorted(wire.DTYPE_CODES)))
def test_any_claimed_shape_with_no_data_decodes_or_is_a_wire_error(dims, code):
    data = (struct.pack("<II", 1, 0) + struct.pack("<BBBBIQ", 1, code, len(dims), 0, 1, 0)
            + b"".join(struct.pack("<Q", d) for d in dims) + b"z")
    data += bytes(-len(data) % 64)
    _decode_within_bound(data)
