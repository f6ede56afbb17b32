"""Authenticated frames over real sockets on 127.0.0.1 (``meshkit.wire._channel``).

The helpers the other wire tests share (a connected channel pair, recording
the exact bytes of a frame, writing raw bytes past the codec) are in
``tests/support/channels.py``.
"""

from __future__ import annotations

import hmac
import math
import socket
import struct
import threading
import time
import tracemalloc
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from meshkit import wire
from meshkit.errors import AuthenticationError, ConfigError, PeerLostError, WireError
from meshkit.wire._channel import _MAC_STEP
from meshkit.testing.support import Call

from tests.support.channels import SECRET, channel_pair, record, send_raw
from tests.support.states import assert_same_state, every_dtype_state


# ----------------------------------------------------------------------------- helpers


def gmac(key: bytes, seq: int, header: bytes, body: bytes) -> bytes:
    """The body tag with encryption off, as docs/wire.md defines it."""
    return AESGCM(key).encrypt(struct.pack("<IQ", 0, seq), header, body)[-16:]


def seal(channel: wire.Channel, seq: int, header: bytes, body: bytes) -> bytes:
    """What follows ``header`` on the wire for ``body``, as docs/wire.md defines it:
    the AES-256-GCM ciphertext and tag (header = associated data), or with
    encryption off the body in clear and its GMAC tag."""
    key = channel._keys.send_body
    if channel.encrypted:
        return AESGCM(key).encrypt(struct.pack("<IQ", 0, seq), body, header)
    return body + gmac(key, seq, header, body)


def _forged_header(nbytes: int, key: bytes | None = None, seq: int = 0) -> bytes:
    head = struct.pack("<4sBBHIIQQ", b"MKF\x01", 1, 0, 0, 7, 1, seq, nbytes)
    mac = hmac.digest(key, head, "sha256") if key else bytes(32)
    return head + mac


class CountingSocket:
    """Wraps a channel's socket to count the bytes its reader consumed."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.read = 0

    def recv_into(self, view: Any, n: int = 0) -> int:
        k = self._sock.recv_into(view, n)
        self.read += k
        return k

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


# ----------------------------------------------------------------------------- roundtrips


def test_every_dtype_and_json_leaf_roundtrips_exactly_over_tcp(pair):
    a, b = pair
    state = every_dtype_state()
    a.send(5, 42, state)
    frame = b.recv()
    assert (frame.kind, frame.tag, frame.sender, frame.seq, frame.bf16) == (5, 42, 0, 0, False)
    assert_same_state(frame.state, state)


def test_decoded_arrays_are_writable_views_of_one_frame_buffer(pair):
    a, b = pair
    a.send(1, 1, {"x": np.ones(4, np.float32), "y": np.zeros(3)})
    frame = b.recv()
    x, y = frame.state["x"], frame.state["y"]
    assert x.flags.writeable and y.flags.writeable
    assert np.shares_memory(x, frame.body)
    x += 1  # folding in place must not disturb the neighbouring entry
    np.testing.assert_array_equal(y, 0)
    assert x.ctypes.data % 8 == 0 and y.ctypes.data % 8 == 0


def test_a_receive_buffer_is_not_recycled_while_a_decoded_array_uses_it(pair):
    a, b = pair
    n = 1 << 15  # 128 KiB frames: in the recycled range
    a.send(1, 1, {"w": np.full(n, 1.0, np.float32)})
    kept = b.recv().state["w"]
    for value in (2.0, 3.0, 4.0, 5.0, 6.0):
        a.send(1, 1, {"w": np.full(n, value, np.float32)})
        other = b.recv().state["w"]
        assert not np.shares_memory(kept, other)
        assert other[0] == value
    np.testing.assert_array_equal(kept, 1.0)


def test_a_receive_buffer_nothing_refers_to_is_recycled(pair):
    a, b = pair
    n = 1 << 15
    a.send(1, 1, {"w": np.zeros(n, np.float32)})
    frame = b.recv()
    address = frame.body.ctypes.data
    del frame
    a.send(1, 1, {"w": np.ones(n, np.float32)})
    frame = b.recv()
    assert frame.body.ctypes.data == address
    np.testing.assert_array_equal(frame.state["w"], 1.0)


def test_bf16_narrows_float32_only_and_widens_back_on_receipt(pair):
    a, b = pair
    weights = np.linspace(-3, 3, 1000, dtype=np.float32)
    state = {"w": weights, "f64": np.array([1 / 3]), "n": np.array([257], np.int32),
             "meta": {"round": 3, "loss": 0.123456789}}
    a.send(2, 9, state, bf16=True)
    frame = b.recv()
    assert frame.bf16
    assert frame.state["w"].dtype == np.float32
    np.testing.assert_allclose(frame.state["w"], weights, rtol=2 ** -8)
    assert frame.state["f64"][0] == 1 / 3  # control values stay exact
    assert frame.state["n"][0] == 257
    assert frame.state["meta"] == {"round": 3, "loss": 0.123456789}
    np.testing.assert_array_equal(frame.state["w"], weights.astype(ml_dtypes.bfloat16))


def test_bf16_frames_are_half_the_size_of_float32_frames(pair):
    a, b = pair
    weights = np.ones(1 << 16, np.float32)
    full = a.send(1, 1, {"w": weights})
    half = a.send(1, 1, {"w": weights}, bf16=True)
    b.recv(), b.recv()
    assert half < full * 0.51


def test_a_large_frame_roundtrips_with_its_body_tag(pair):
    a, b = pair
    big = {"w": np.random.default_rng(1).standard_normal(3 << 20).astype(np.float32)}
    sending = Call(lambda: a.send(1, 3, big))
    frame = b.recv()
    assert sending.result() == frame.nbytes
    np.testing.assert_array_equal(frame.state["w"], big["w"])


def test_both_directions_work_concurrently_from_one_sender_and_one_receiver_thread(pair):
    a, b = pair
    n = 50

    def pump(ch: wire.Channel, base: int) -> list[int]:
        sender = Call(lambda: [ch.send(1, base + i, {"i": i, "x": np.full(1000, i)})
                               for i in range(n)])
        got = [ch.recv().state["i"] for _ in range(n)]
        sender.result()
        return got

    other = Call(lambda: pump(b, 1000))
    assert pump(a, 0) == list(range(n))
    assert other.result() == list(range(n))


def test_concurrent_senders_on_one_channel_never_interleave_frames(pair):
    a, b = pair
    payload = np.arange(100_000, dtype=np.int64)
    senders = [Call(lambda t=t: [a.send(1, t, {"x": payload}) for _ in range(5)])
               for t in range(4)]
    frames = [b.recv() for _ in range(20)]
    for s in senders:
        s.result()
    assert sorted(f.tag for f in frames) == sorted(list(range(4)) * 5)
    assert [f.seq for f in frames] == list(range(20))
    for f in frames:
        np.testing.assert_array_equal(f.state["x"], payload)


def test_one_encoded_body_is_scattered_to_many_peers():
    first, peer_1 = channel_pair()
    second, peer_2 = channel_pair()
    encoded = wire.encode_state({"w": np.arange(1 << 18, dtype=np.float32)}, bf16=True)
    first.send_encoded(2, 5, encoded)
    second.send_encoded(2, 5, encoded)
    got_1, got_2 = peer_1.recv(), peer_2.recv()
    np.testing.assert_array_equal(got_1.state["w"], got_2.state["w"])
    for ch in (first, peer_1, second, peer_2):
        ch.close()


def test_forward_relays_a_frame_body_unchanged_with_the_original_sender():
    a, hub_a = channel_pair()
    hub_b, c = channel_pair()
    a.send(4, 77, {"x": np.arange(5)}, bf16=False)
    frame = hub_a.recv()
    hub_b.forward(frame)
    relayed = c.recv()
    assert (relayed.kind, relayed.tag, relayed.sender) == (4, 77, frame.sender)
    np.testing.assert_array_equal(relayed.state["x"], np.arange(5))
    for ch in (a, hub_a, hub_b, c):
        ch.close()


def test_forward_now_writes_a_whole_frame_or_nothing_and_never_waits():
    """A relay's reader thread uses forward_now: while the destination reads nothing,
    it must report False without writing a byte, so the stream stays in sync."""
    a, hub_a = channel_pair()
    hub_b, c = channel_pair()
    hub_b._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
    a.send(4, 1, {"x": np.arange(256, dtype=np.float32)})
    frame = hub_a.recv()
    written = 0
    for _ in range(10_000):  # c reads nothing, so the buffers fill up
        if not hub_b.forward_now(frame):
            break
        written += 1
    else:
        pytest.fail("forward_now never reported a full send buffer")
    # (Had it waited for room instead, the loop would have ended in the 5 s stall
    # timeout's PeerLostError.)
    assert written > 0  # the first frames went straight out
    got = [c.recv(timeout=5) for _ in range(written)]
    assert [f.seq for f in got] == list(range(written))
    np.testing.assert_array_equal(got[-1].state["x"], np.arange(256, dtype=np.float32))
    with pytest.raises(wire.RecvTimeout):
        c.recv(timeout=0.2)  # nothing half-written follows
    hub_b.forward(frame)  # and the stream is still in sync for the next frame
    assert c.recv(timeout=5).seq == written
    for ch in (a, hub_a, hub_b, c):
        ch.close()


# ----------------------------------------------------------------------------- forged frames


def assert_refused_after_the_header_alone(channel: wire.Channel, error: type[Exception],
                                          match: str) -> None:
    """``channel.recv()`` raises ``error`` having read only the header and
    allocated nothing body-sized."""
    counting = channel._sock = CountingSocket(channel._sock)  # type: ignore[assignment]
    tracemalloc.start()
    try:
        with pytest.raises(error, match=match):
            channel.recv()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"a body-sized buffer was allocated ({peak} bytes)"
    assert counting.read == wire.HEADER_SIZE  # not one byte of the "body" was read


def test_a_forged_header_is_rejected_after_reading_only_the_header(pair):
    a, b = pair
    claimed = 512 << 20
    send_raw(a, _forged_header(claimed) + b"x" * 4096)
    assert_refused_after_the_header_alone(b, AuthenticationError,
                                          "header .* failed authentication")
    assert b.closed


def test_an_oversized_body_is_refused_before_it_is_allocated_or_read():
    a, b = channel_pair()
    b.max_frame = 1 << 20
    # A correctly authenticated header (the peer really holds the key) that
    # announces more than this node accepts.
    send_raw(a, _forged_header(1 << 40, key=a._keys.send_header) + b"x" * 4096)
    assert_refused_after_the_header_alone(b, WireError, "refused before reading")
    a.close(), b.close()


def test_an_authenticated_frame_claiming_too_many_tensors_is_refused(pair):
    a, b = pair
    body = struct.pack("<II", wire.MAX_TENSORS + 1, 0) + bytes(24)
    # MAC a body with a hostile count, as a buggy peer holding the key could.
    header = _forged_header(len(body), key=a._keys.send_header)
    send_raw(a, header + seal(a, 0, header, body))
    with pytest.raises(WireError, match="65537 entries; the limit is 65536"):
        b.recv()


def test_a_replayed_frame_is_refused(pair):
    a, b = pair
    (frame,) = record(a, (1, 1, {"x": 1}))
    send_raw(a, frame)
    assert b.recv().state == {"x": 1}
    send_raw(a, frame)
    with pytest.raises(AuthenticationError, match="sequence number 0, expected 1.*replayed"):
        b.recv()


def test_a_reordered_frame_is_refused(pair):
    a, b = pair
    first, second = record(a, (1, 1, {"n": 1}), (1, 1, {"n": 2}))
    send_raw(a, second + first)
    with pytest.raises(AuthenticationError, match="sequence number 1, expected 0"):
        b.recv()


def test_a_reflected_frame_is_refused(pair):
    a, b = pair
    (own,) = record(b, (1, 1, {"x": 1}))
    send_raw(a, own)  # b's own frame, echoed back to b
    with pytest.raises(AuthenticationError, match="forged, corrupted or reflected"):
        b.recv()


def test_a_body_tag_is_bound_to_its_header(pair):
    a, b = pair
    body = struct.pack("<II", 0, 0)
    header = _forged_header(len(body), key=a._keys.send_header)
    # A valid header MAC, but the body tag was computed for another header
    # (a different tag field) carrying the same body and sequence number.
    other = struct.pack("<4sBBHIIQQ", b"MKF\x01", 1, 0, 0, 8, 1, 0, len(body))
    other += hmac.digest(a._keys.send_header, other, "sha256")
    send_raw(a, header + seal(a, 0, other, body))
    with pytest.raises(AuthenticationError, match="body .* failed authentication"):
        b.recv()


def test_a_body_tag_from_another_sequence_number_is_refused(pair):
    a, b = pair
    body = struct.pack("<II", 0, 0)
    header = _forged_header(len(body), key=a._keys.send_header)
    send_raw(a, header + seal(a, 1, header, body))
    with pytest.raises(AuthenticationError, match="body .* failed authentication"):
        b.recv()


@pytest.mark.parametrize("encrypt", [True, False], ids=["encrypted", "authenticated"])
@pytest.mark.parametrize("n", [16, 1 << 17, 1 << 20],
                         ids=["small-one-shot", "large-streamed", "pieces"])
def test_frames_carry_the_body_and_16_byte_tag_the_docs_define(n, encrypt):
    # 8 MiB segments: the 4 MiB body here is one frame, sent in pieces (wire.md §2.2).
    a, b = channel_pair(encrypt=encrypt, segment=8 << 20)
    assert a.encrypted is b.encrypted is encrypt
    state = {"x": np.arange(n, dtype=np.float32), "meta": {"round": 1}}
    first, second = record(a, (1, 1, state), (1, 2, state))
    body = wire.encode_state(state)
    plain = b"".join(bytes(_byte(buf)) for buf in body.buffers)
    for seq, frame in enumerate((first, second)):
        assert len(frame) == wire.HEADER_SIZE + body.nbytes + wire.BODY_TAG_SIZE == \
            wire.HEADER_SIZE + body.nbytes + 16
        header = frame[:wire.HEADER_SIZE]
        assert frame[wire.HEADER_SIZE:] == seal(a, seq, header, plain)
        assert (plain in frame) is not encrypt
    # A new nonce per frame: the same body never gets the same tag twice.
    assert first[-16:] != second[-16:]
    writing = Call(lambda: send_raw(a, first + second))
    got = [b.recv(), b.recv()]
    assert [frame.tag for frame in got] == [1, 2]
    np.testing.assert_array_equal(got[1].state["x"], state["x"])
    writing.result()
    a.close(), b.close()


def _byte(buf: Any) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def test_a_tampered_large_body_is_refused_when_authenticated_while_reading(pair):
    a, b = pair
    (frame,) = record(a, (1, 1, {"x": np.zeros(1 << 19, np.float32)}))
    assert len(frame) > 2 * _MAC_STEP  # authenticated in pieces as it arrives
    tampered = bytearray(frame)
    tampered[len(frame) - 16 - 5] ^= 0x80  # the body's last bytes
    writing = Call(lambda: send_raw(a, bytes(tampered)))
    with pytest.raises(AuthenticationError, match="body .* failed authentication"):
        b.recv()
    writing.result()


def test_a_tampered_body_is_refused(pair):
    a, b = pair
    (frame,) = record(a, (1, 1, {"x": np.zeros(16)}))
    tampered = bytearray(frame)
    tampered[wire.HEADER_SIZE + 100] ^= 0x01
    send_raw(a, bytes(tampered))
    with pytest.raises(AuthenticationError, match="body .* failed authentication"):
        b.recv()


# ----------------------------------------------------------------------------- stalls, timeouts and loss


def test_a_peer_that_stops_mid_frame_is_dropped_after_the_timeout():
    a, b = channel_pair(timeout=0.3)
    (frame,) = record(a, (1, 1, {"x": np.zeros(4096)}))
    send_raw(a, frame[: len(frame) // 2])
    with pytest.raises(PeerLostError, match="stalled"):
        b.recv()
    assert b.closed
    a.close()


def test_waiting_for_a_frame_that_never_starts_leaves_the_channel_usable(pair):
    a, b = pair
    with pytest.raises(wire.RecvTimeout, match="no frame"):
        b.recv(timeout=0.05)
    assert not b.closed
    a.send(1, 2, {"ok": True})
    assert b.recv().state == {"ok": True}


def test_a_peer_that_closes_mid_frame_is_lost(pair):
    a, b = pair
    (frame,) = record(a, (1, 1, {"x": np.zeros(64)}))
    send_raw(a, frame[:100])
    a.close()
    with pytest.raises(PeerLostError, match="closed the connection after"):
        b.recv()


def test_closing_a_channel_wakes_a_thread_blocked_in_recv(pair):
    a, b = pair
    waiting = Call(lambda: b.recv(timeout=None))
    b.close()
    with pytest.raises(PeerLostError):
        waiting.result(timeout=5)


def test_sending_on_a_closed_channel_is_peer_lost(pair):
    a, b = pair
    a.close()
    with pytest.raises(PeerLostError, match="closed"):
        a.send(1, 1, {})


def test_a_peer_that_stops_reading_makes_send_fail_after_the_stall_timeout():
    a, b = channel_pair(timeout=0.3)
    with pytest.raises(PeerLostError, match="took no data for 0.3 s"):
        a.send(1, 1, {"w": np.zeros(16 << 20, np.uint8)})  # b never reads
    assert a.closed
    b.close()


def _trickle_reader(sock: socket.socket, stop: threading.Event) -> threading.Thread:
    """Reads ``sock`` slowly but steadily: 64 KiB every 20 ms, never stalling."""
    def run() -> None:
        for _ in range(2000):  # bounded: 40 s at most
            try:
                if not sock.recv(65536):
                    return
            except BlockingIOError:
                pass
            except OSError:
                return
            if stop.wait(0.02):
                return
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_write_deadline_drops_a_peer_that_reads_too_slowly():
    # b keeps reading, so the 5 s stall timeout never trips; the deadline must.
    a, b = channel_pair(timeout=5.0)
    stop = threading.Event()
    reader = _trickle_reader(b._sock, stop)
    try:
        with pytest.raises(PeerLostError, match="deadline passed") as err:
            a.send(1, 1, {"w": np.zeros(64 << 20, np.uint8)},
                   deadline=time.monotonic() + 0.5)
        assert "reads too slowly" in str(err.value)
        assert a.closed
    finally:
        stop.set()
        reader.join(5)
        b.close()


def test_a_write_within_its_deadline_is_delivered_whole(pair):
    a, b = pair
    payload = np.arange(1 << 20, dtype=np.float32)
    received = Call(b.recv)
    a.send(1, 7, {"w": payload}, deadline=time.monotonic() + 30)
    frame = received.result()
    np.testing.assert_array_equal(frame.state["w"], payload)


def test_recv_accepts_an_infinite_wait_and_a_changed_timeout(pair):
    a, b = pair
    a.send(1, 1, {"k": 1})
    assert b.recv(timeout=float("inf")).state == {"k": 1}
    b.timeout = 0.25
    assert b.timeout == 0.25
    with pytest.raises(ConfigError, match="positive"):
        b.timeout = 0


@pytest.mark.parametrize("stall", [1e9, math.inf])
def test_a_very_long_channel_timeout_does_not_overflow_the_poll(stall) -> None:
    # The config refuses inf, so "wait for ever" is written 1e9 s; poll()
    # takes at most 2**31 - 1 ms, and every frame that had to wait for the
    # socket died with a bare OverflowError (the timeout setter allows inf).
    with socket.create_server(("127.0.0.1", 0)) as listener:
        dialer = socket.create_connection(listener.getsockname(), timeout=5)
        accepted, _ = listener.accept()
    result: dict = {}

    def other_end() -> None:
        try:
            channel = wire.handshake(accepted, SECRET, rank=1, world=2, timeout=30.0)
            channel.timeout = stall
            result["channel"] = channel
            channel.send(1, 7, {"w": np.ones(4 << 20, np.float32)})  # 16 MiB: must wait
        except BaseException as exc:  # noqa: BLE001 - reported below
            result["error"] = exc

    thread = threading.Thread(target=other_end, daemon=True)
    thread.start()
    channel = wire.handshake(dialer, SECRET, rank=0, world=2, timeout=30.0)
    channel.timeout = stall
    try:
        frame = channel.recv(timeout=60.0)
        thread.join(10)
        assert "error" not in result, result.get("error")
        assert frame.tag == 7 and frame.state["w"].shape == (4 << 20,)
    finally:
        channel.close()
        if "channel" in result:
            result["channel"].close()
