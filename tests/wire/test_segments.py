"""A body above a link's segment size travels as a lead frame and segments (issue 39).

Real channel pairs over 127.0.0.1; what crosses the socket is read back
with the frame parser of ``tests/support/frames.py``, so "no frame is
bigger than a segment" is checked on the bytes, not on the sender's word.
"""

from __future__ import annotations

import hmac
import struct
import tracemalloc

import numpy as np
import pytest

from meshkit import wire
from meshkit.errors import ConfigError, WireError
from meshkit.testing.support import Call

from tests.support.channels import channel_pair, send_raw
from tests.support.frames import FrameParser

UNIT = wire.SEGMENT_UNIT


def _model(params: int) -> dict[str, object]:
    rng = np.random.default_rng(7)
    return {"w": rng.standard_normal(params).astype(np.float32),
            "b": rng.standard_normal((3, 5)).astype(np.float64),
            "steps": np.arange(4, dtype=np.int64), "meta": {"round": 3}}


def _wire_frames(sender: wire.Channel, receiver: wire.Channel,
                 state: dict[str, object]) -> tuple[wire.Frame, list[tuple[int, int]]]:
    """Send ``state``; the frame received and every frame that crossed the socket."""
    parser = FrameParser()
    parser._skip = 0  # the handshake is behind us: the recording starts at a frame
    real = sender._sock

    class Tap:
        def send(self, view: memoryview) -> int:
            n = real.send(view)
            parser.feed(bytes(view[:n]))
            return n

        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

    sender._sock = Tap()  # type: ignore[assignment]
    try:
        sending = Call(lambda: sender.send(3, 9, state))
        frame = receiver.recv()
        sending.result()
    finally:
        sender._sock = real
    return frame, parser.frames


@pytest.mark.parametrize("encrypt", [True, False], ids=["encrypted", "plaintext"])
def test_a_body_above_the_segment_size_arrives_whole_in_frames_of_at_most_one_segment(encrypt):
    a, b = channel_pair(segment=UNIT, encrypt=encrypt)
    state = _model(300_000)  # 1.2 MB: 19 segments of 64 KiB
    frame, frames = _wire_frames(a, b, state)
    body = frame.nbytes
    assert frame.segments == -(-body // UNIT) == 19
    assert np.array_equal(frame.state["w"], state["w"])
    assert np.array_equal(frame.state["b"], state["b"])
    assert np.array_equal(frame.state["steps"], state["steps"])
    assert frame.state["meta"] == {"round": 3}
    # On the socket: one lead frame, then the segments, none above 64 KiB.
    assert frames[0] == (wire.FLAG_SEGMENTED, wire.SEGMENT_LEAD.size)
    assert [flags for flags, _ in frames[1:]] == [wire.FLAG_SEGMENT] * 19
    assert max(n for _, n in frames) == UNIT
    assert sum(n for _, n in frames[1:]) == body
    assert a.largest_sent == b.largest_received == UNIT
    # The stream stays in step: the next (small) frame is one ordinary frame.
    frame, frames = _wire_frames(a, b, {"x": 1})
    assert frame.state == {"x": 1} and frame.segments == 0 and len(frames) == 1
    a.close(), b.close()


def test_a_message_larger_than_max_frame_travels_in_segments():
    # Today a body above the ceiling the peer announced could not be sent at all.
    a, b = channel_pair(max_frame=2 * UNIT)
    state = {"w": np.arange(1 << 20, dtype=np.float32)}  # 4 MiB, 32x the ceiling
    frame, frames = _wire_frames(a, b, state)
    assert max(n for _, n in frames) == 2 * UNIT  # cut at max_frame, below the 4 MiB default
    assert np.array_equal(frame.state["w"], state["w"])
    a.close(), b.close()


def test_both_directions_cut_at_the_smaller_of_the_two_ends_segment_sizes():
    # One end asked for 64 KiB segments, the other for 256 KiB: 64 KiB both ways.
    a, b = _mixed_pair(UNIT, 4 * UNIT)
    assert a.segment_bytes == b.segment_bytes == UNIT
    frame, frames = _wire_frames(b, a, _model(100_000))
    assert max(n for _, n in frames) == UNIT
    a.close(), b.close()


def _mixed_pair(segment_a: int, segment_b: int) -> tuple[wire.Channel, wire.Channel]:
    from tests.support.channels import SECRET, tcp_pair

    sa, sb = tcp_pair()
    other = Call(lambda: wire.handshake(sb, SECRET, rank=1, world=2, timeout=5.0,
                                        segment=segment_b))
    return wire.handshake(sa, SECRET, rank=0, world=2, timeout=5.0, segment=segment_a), \
        other.result()


@pytest.mark.parametrize("bad", [0, 1000, UNIT + 1, wire.MAX_SEGMENT_BYTES + UNIT, True])
def test_a_segment_size_the_hello_cannot_carry_is_refused_before_connecting(bad):
    from tests.support.channels import tcp_pair

    sa, sb = tcp_pair()
    with pytest.raises(ConfigError, match="multiple of 65536|integer number of bytes"):
        wire.handshake(sa, b"x" * 32, rank=0, world=2, segment=bad)
    sb.close()


def _lead(channel: wire.Channel, seq: int, total: int, count: int, size: int,
          tag: int = 7) -> bytes:
    """A lead frame as a peer holding the keys could write it."""
    head = struct.pack("<4sBBHIIQQ", b"MKF\x01", 1, wire.FLAG_SEGMENTED, 0, tag, 0, seq,
                       wire.SEGMENT_LEAD.size)
    header = head + hmac.digest(channel._keys.send_header, head, "sha256")
    return header + _seal(channel, seq, header, wire.SEGMENT_LEAD.pack(total, count, size))


def _seal(channel: wire.Channel, seq: int, header: bytes, body: bytes) -> bytes:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM(channel._keys.send_body).encrypt(struct.pack("<IQ", 0, seq), body, header)


def test_a_lead_claiming_more_than_max_message_is_refused_before_its_buffer_exists():
    a, b = channel_pair()
    b.max_message = 1 << 30
    send_raw(a, _lead(a, 0, 1 << 40, 1 << 22, 1 << 18))
    tracemalloc.start()
    try:
        with pytest.raises(WireError, match="above this node's max_message"):
            b.recv()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"a body-sized buffer was allocated ({peak} bytes)"
    assert b.closed
    a.close()


@pytest.mark.parametrize("claim, match", [
    ((1000, 3, UNIT), "3 segments of 65536 bytes for a 1000-byte message"),
    ((0, 0, UNIT), "0 segments"),
    ((10 * UNIT, 10, 0), "segments of 0 bytes"),
])
def test_a_lead_whose_claims_do_not_add_up_is_refused(claim, match):
    a, b = channel_pair()
    send_raw(a, _lead(a, 0, *claim))
    with pytest.raises(WireError, match=match):
        b.recv()
    assert b.closed
    a.close()


def test_a_segment_no_lead_announced_is_refused():
    a, b = channel_pair()
    head = struct.pack("<4sBBHIIQQ", b"MKF\x01", 1, wire.FLAG_SEGMENT, 0, 7, 0, 0, 16)
    header = head + hmac.digest(a._keys.send_header, head, "sha256")
    send_raw(a, header + _seal(a, 0, header, bytes(16)))
    with pytest.raises(WireError, match="no lead frame announced"):
        b.recv()
    a.close()


def test_another_frame_between_the_segments_is_refused():
    a, b = channel_pair()
    lead = _lead(a, 0, 2 * UNIT, 2, UNIT)
    # What follows the lead is an ordinary frame of another tag.
    head = struct.pack("<4sBBHIIQQ", b"MKF\x01", 1, 0, 0, 8, 0, 1, 16)
    header = head + hmac.digest(a._keys.send_header, head, "sha256")
    send_raw(a, lead + header + _seal(a, 1, header, bytes(16)))
    with pytest.raises(WireError, match="is not its segment 1"):
        b.recv()
    assert b.closed
    a.close()


def _send_segmented(a: wire.Channel, b: wire.Channel, value: float, n: int) -> wire.Frame:
    sending = Call(lambda: a.send(1, 1, {"w": np.full(n, value, np.float32)}))
    frame = b.recv()
    sending.result()
    assert frame.segments > 1
    return frame


def test_a_segmented_body_nothing_refers_to_is_recycled_for_the_next_message():
    # A piece-sized message (here 1.2 MB in 64 KiB segments) is read into the one
    # recycled message buffer once the last one's arrays are dropped: no fresh
    # mmap (and kernel page zeroing) per pulled piece.
    from meshkit.wire import _buffers

    a, b = channel_pair(segment=UNIT)
    try:
        frame = _send_segmented(a, b, 1.0, 300_000)
        address = frame.body.ctypes.data
        del frame
        frame = _send_segmented(a, b, 2.0, 300_000)
        # Not just the same address (malloc may hand that back): the recycled buffer.
        assert any(np.shares_memory(frame.body, slot) for slot in _buffers._message_slots)
        assert frame.body.ctypes.data == address
        np.testing.assert_array_equal(frame.state["w"], 2.0)
        del frame
        smaller = _send_segmented(a, b, 3.0, 200_000)  # a smaller body: the same memory
        assert smaller.body.ctypes.data == address
        assert smaller.nbytes == smaller.body.nbytes
        np.testing.assert_array_equal(smaller.state["w"], 3.0)
    finally:
        a.close()
        b.close()


def test_a_segmented_body_is_not_recycled_while_a_decoded_array_uses_it():
    a, b = channel_pair(segment=UNIT)
    try:
        kept = _send_segmented(a, b, 1.0, 300_000).state["w"]
        for value in (2.0, 3.0, 4.0):
            other = _send_segmented(a, b, value, 300_000).state["w"]
            assert not np.shares_memory(kept, other)
            np.testing.assert_array_equal(other, value)
        np.testing.assert_array_equal(kept, 1.0)
    finally:
        a.close()
        b.close()


def test_a_segmented_body_above_the_recycled_size_gets_its_own_buffer(monkeypatch):
    from meshkit.wire import _buffers

    monkeypatch.setattr(_buffers, "_MESSAGE_MAX", 1 << 20)  # 1 MiB: the 1.2 MB body is above
    a, b = channel_pair(segment=UNIT)
    try:
        frame = _send_segmented(a, b, 1.0, 300_000)
        assert not any(np.shares_memory(frame.body, held)
                       for held in [*_buffers._message_slots, *_buffers._large_slots])
    finally:
        a.close()
        b.close()


def test_a_large_body_is_read_into_a_kept_buffer_only_when_the_process_asked(monkeypatch):
    # A worker holds the model it was sent until the next one arrived: with
    # recycle_large_messages(2) two buffers take turns, so the third body is read
    # into the first one's memory (no fresh mapping the kernel zeroes); without it,
    # every large body is a buffer of its own.
    from meshkit.wire import _buffers

    monkeypatch.setattr(_buffers, "_MESSAGE_MAX", 1 << 20)  # 1 MiB: 1.2 MB bodies are above
    monkeypatch.setattr(_buffers, "_large_slots", [])
    a, b = channel_pair(segment=UNIT)
    try:
        wire.recycle_large_messages(2)
        held = _send_segmented(a, b, 1.0, 300_000)  # round 1's model, held
        first = held.body.ctypes.data
        held = _send_segmented(a, b, 2.0, 300_000)  # round 2's arrives while 1's is held
        assert held.body.ctypes.data != first
        np.testing.assert_array_equal(held.state["w"], 2.0)
        third = _send_segmented(a, b, 3.0, 300_000)  # round 1's is free now: its memory
        assert any(np.shares_memory(third.body, slot) for slot in _buffers._large_slots)
        assert third.body.ctypes.data == first and not np.shares_memory(third.body, held.body)
        np.testing.assert_array_equal(third.state["w"], 3.0)
        np.testing.assert_array_equal(held.state["w"], 2.0)  # the held one untouched
        del held, third
        wire.recycle_large_messages(0)
        assert _buffers._large_slots == []  # nothing idle kept once it is off
        one = _send_segmented(a, b, 4.0, 300_000)
        two = _send_segmented(a, b, 5.0, 300_000)
        assert not np.shares_memory(one.body, two.body)
        assert _buffers._large_slots == []
    finally:
        wire.recycle_large_messages(0)
        a.close()
        b.close()


def test_recycle_large_messages_refuses_a_count_it_cannot_bound():
    with pytest.raises(ValueError, match="0 to 4"):
        wire.recycle_large_messages(5)


def test_an_idle_recycled_buffer_too_small_for_the_next_body_is_replaced(monkeypatch):
    from meshkit.wire import _buffers

    monkeypatch.setattr(_buffers, "_MESSAGE_SLOTS", 1)
    monkeypatch.setattr(_buffers, "_message_slots", [])
    a, b = channel_pair(segment=UNIT)
    try:
        small = _send_segmented(a, b, 1.0, 200_000)  # the one slot: 0.8 MB
        assert np.shares_memory(small.body, _buffers._message_slots[0])
        del small  # idle now
        frame = _send_segmented(a, b, 2.0, 300_000)  # bigger: a new buffer takes the slot
        assert len(_buffers._message_slots) == 1
        assert np.shares_memory(frame.body, _buffers._message_slots[0])
        address = frame.body.ctypes.data
        del frame
        again = _send_segmented(a, b, 3.0, 300_000)
        assert again.body.ctypes.data == address
        np.testing.assert_array_equal(again.state["w"], 3.0)
    finally:
        a.close()
        b.close()
