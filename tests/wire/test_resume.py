"""A cut transfer resumes from its last verified segment (issue 39, docs/wire.md §2.5).

Real sockets on 127.0.0.1 through ``tests/support/cutting_proxy.py``, a
protocol-blind proxy that cuts the first connection after a set number of
bytes and counts what crosses each connection: "the bytes sent after the
reconnect" are the proxy's count, not either end's word.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from meshkit import wire
from meshkit.errors import DigestMismatchError, PeerLostError, WireError
from meshkit.testing.support import Call
from meshkit.wire import _handshake, _partials, _resume
from tests.support.channels import SECRET
from tests.support.cutting_proxy import CuttingProxy

SEGMENT = 4 * wire.SEGMENT_UNIT  # 256 KiB
PARAMS = 4 << 20  # 16 MiB of float32: 64 segments


def _contribution(params: int = PARAMS) -> dict[str, Any]:
    rng = np.random.default_rng(39)
    return {"w": rng.standard_normal(params).astype(np.float32),
            "b": np.arange(10, dtype=np.float64), "meta": {"round": 3, "examples": 120}}


def _wire_bytes(nbytes: int, segment: int = SEGMENT) -> int:
    """What a resumable message of ``nbytes`` costs on a fresh connection: the handshake
    (hello and confirmation), the lead, and every segment as a frame (docs/wire.md)."""
    count = -(-nbytes // segment)
    frame = wire.HEADER_SIZE + wire.BODY_TAG_SIZE
    return (wire.HELLO_SIZE + 32) + (frame + wire.RESUME_LEAD.size) + count * frame + nbytes


class Receiver:
    """Rank 0: accepts connections (through the proxy) and receives one message on each."""

    def __init__(self, store: wire.PartialStore | None, **kwargs: Any) -> None:
        self.store = store
        self.kwargs = kwargs
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(10)
        self.address = self.listener.getsockname()
        self.channels: list[wire.Channel] = []

    def accept(self) -> wire.Channel:
        conn, _ = self.listener.accept()
        channel = wire.handshake(conn, SECRET, rank=0, world=2, timeout=10.0, segment=SEGMENT,
                                 partials=self.store, **self.kwargs)
        self.channels.append(channel)
        return channel

    def receive(self) -> Call:
        """Accept the next connection and receive one frame on it, on a thread."""
        return Call(lambda: self.accept().recv(timeout=30), "receiver")

    def close(self) -> None:
        self.listener.close()
        for channel in self.channels:
            channel.close()


def _dial(proxy: CuttingProxy, **kwargs: Any) -> wire.Channel:
    sock = socket.create_connection(proxy.address, timeout=10)
    return wire.handshake(sock, SECRET, rank=1, world=2, timeout=10.0, segment=SEGMENT, **kwargs)


def _cut_transfer(receiver: Receiver, proxy: CuttingProxy,
                  state: dict[str, Any]) -> wire.Transfer:
    """Send ``state`` resumably on a first connection the proxy cuts; the receiver parks it."""
    receiving = receiver.receive()
    channel = _dial(proxy)
    transfer = wire.Transfer.of(state)
    try:
        channel.send_resumable(3, 9, transfer)
    except PeerLostError:
        pass  # usual: the proxy closed the socket under the sender
    # The kernel may have taken every byte before the cut: only the receiver knows.
    with pytest.raises(PeerLostError):
        receiving.result(30)
    channel.close()
    return transfer


@pytest.fixture
def receiver():
    rx = Receiver(wire.PartialStore())
    yield rx
    rx.close()


def _equal(frame: wire.Frame, state: dict[str, Any]) -> None:
    assert np.array_equal(frame.state["w"], state["w"])
    assert np.array_equal(frame.state["b"], state["b"])
    assert frame.state["meta"] == state["meta"]


def test_a_transfer_cut_at_half_resumes_and_sends_less_than_the_remainder_plus_a_segment(
        receiver):
    state = _contribution()
    body = wire.encode_state(state).nbytes
    whole = _wire_bytes(body)
    cut_at = whole // 2 + 1000  # mid-segment, about half of the contribution
    with CuttingProxy(receiver.address, cuts=[cut_at]) as proxy:
        transfer = _cut_transfer(receiver, proxy, state)
        assert proxy.link(0).up == cut_at
        assert len(receiver.store) == 1 and transfer.id in receiver.store
        receiving = receiver.receive()
        channel = _dial(proxy, offers=[transfer])
        answer = channel.resume_answers[transfer.id]
        assert answer.status == _partials.RESUMED
        # The receiver verified every segment that arrived whole before the cut.
        held = (cut_at - (wire.HELLO_SIZE + 32) - (wire.HEADER_SIZE + wire.BODY_TAG_SIZE
                                                   + wire.RESUME_LEAD.size))
        assert answer.first == held // (wire.HEADER_SIZE + SEGMENT + wire.BODY_TAG_SIZE)
        assert len(receiver.store) == 0  # claimed by the new connection
        sent = channel.send_resumable(3, 9, transfer)
        frame = receiving.result(60)
        _equal(frame, state)
        assert frame.resumed_from == answer.first and transfer.resumed_from == answer.first
        assert sent == body - answer.first * SEGMENT
        after = proxy.link(1).up
        remainder = whole - cut_at
        assert after < remainder + SEGMENT, (after, remainder)
        # The largest frame on the wire is one segment, before the cut and after it.
        assert max(ch.largest_received for ch in receiver.channels) == SEGMENT
        channel.close()


def test_a_body_that_changed_where_the_receiver_holds_it_is_a_digest_mismatch(receiver):
    state = _contribution(1 << 20)
    with CuttingProxy(receiver.address, cuts=[2 << 20]) as proxy:
        transfer = _cut_transfer(receiver, proxy, state)
        state["w"][0] += 1.0  # the encoded body refers to the array: its first segment changed
        receiving = receiver.receive()
        channel = _dial(proxy, offers=[transfer])
        assert channel.resume_answers[transfer.id].first > 0
        try:
            channel.send_resumable(3, 9, transfer)
        except PeerLostError:
            pass  # the receiver may close on the error before the last segment
        with pytest.raises(DigestMismatchError, match="changed between the attempts"):
            receiving.result(30)
        assert len(receiver.store) == 0
        channel.close()
        # No crash: the next transfer, started over, arrives.
        receiving = receiver.receive()
        channel = _dial(proxy, offers=[transfer])
        assert channel.resume_answers[transfer.id].status == _partials.UNKNOWN
        channel.send_resumable(3, 9, transfer)
        _equal(receiving.result(30), state)
        channel.close()


def _offer_again(receiver: Receiver, proxy: CuttingProxy, transfer: wire.Transfer,
                 state: dict[str, Any], status: int) -> None:
    """Offer ``transfer``: answered ``status``, it starts over and arrives whole."""
    receiving = receiver.receive()
    channel = _dial(proxy, offers=[transfer])
    answer = channel.resume_answers[transfer.id]
    assert (answer.status, answer.first) == (status, 0)
    assert channel.send_resumable(3, 9, transfer) == wire.encode_state(state).nbytes
    frame = receiving.result(30)
    _equal(frame, state)
    assert frame.resumed_from == 0
    channel.close()


def test_another_body_offered_under_the_transfer_id_is_a_digest_mismatch(receiver):
    state = _contribution(1 << 20)
    with CuttingProxy(receiver.address, cuts=[2 << 20]) as proxy:
        cut = _cut_transfer(receiver, proxy, state)
        other = _contribution(1 << 20)
        other["w"] = -other["w"]  # same layout, other numbers
        impostor = wire.Transfer(wire.encode_state(other), id=cut.id, size=cut.size)
        receiving = receiver.receive()
        channel = _dial(proxy, offers=[impostor])
        assert channel.resume_answers[cut.id].status == _partials.RESUMED
        try:
            channel.send_resumable(3, 9, impostor)
        except PeerLostError:
            pass
        with pytest.raises(DigestMismatchError, match=r"does not match the digest its offer"):
            receiving.result(30)
        assert len(receiver.store) == 0
        channel.close()


def test_a_body_that_changed_only_where_it_was_not_sent_yet_resumes_to_the_new_body(receiver):
    state = _contribution(1 << 20)
    with CuttingProxy(receiver.address, cuts=[2 << 20]) as proxy:
        transfer = _cut_transfer(receiver, proxy, state)
        state["w"][-1] += 1.0  # past the cut: the receiver holds none of it
        receiving = receiver.receive()
        channel = _dial(proxy, offers=[transfer])
        assert channel.resume_answers[transfer.id].first > 0
        channel.send_resumable(3, 9, transfer)
        frame = receiving.result(30)
        _equal(frame, state)
        assert frame.resumed_from > 0
        channel.close()


@pytest.mark.parametrize("cuts", [2, 3], ids=["cut-once", "cut-twice"])
def test_a_transfer_cut_again_while_resuming_resumes_again(receiver, cuts):
    state = _contribution(1 << 20)
    body = wire.encode_state(state).nbytes
    with CuttingProxy(receiver.address, cuts=[1 << 20, 1 << 20, 1 << 20][:cuts - 1]) as proxy:
        transfer = _cut_transfer(receiver, proxy, state)
        firsts = [0]
        for attempt in range(1, cuts):
            receiving = receiver.receive()
            channel = _dial(proxy, offers=[transfer])
            firsts.append(channel.resume_answers[transfer.id].first)
            try:
                channel.send_resumable(3, 9, transfer)
            except PeerLostError:
                pass
            if attempt < cuts - 1:
                with pytest.raises(PeerLostError):
                    receiving.result(30)
            else:
                _equal(receiving.result(30), state)
            channel.close()
        assert firsts == sorted(firsts) and len(set(firsts)) == len(firsts)  # always forward
        assert proxy.link(cuts - 1).up < body


def test_an_expired_partial_starts_over_and_the_answer_says_it_expired():
    now = [1000.0]
    rx = Receiver(wire.PartialStore(ttl=30.0, clock=lambda: now[0]))
    state = _contribution(1 << 20)
    try:
        with CuttingProxy(rx.address, cuts=[2 << 20]) as proxy:
            transfer = _cut_transfer(rx, proxy, state)
            assert len(rx.store) == 1
            now[0] += 31.0
            _offer_again(rx, proxy, transfer, state, _partials.EXPIRED)
            assert rx.store.expired == 1 and len(rx.store) == 0
    finally:
        rx.close()


def test_a_receiver_that_keeps_no_partials_answers_start_over():
    rx = Receiver(None)
    state = _contribution(1 << 20)
    try:
        with CuttingProxy(rx.address, cuts=[2 << 20]) as proxy:
            transfer = _cut_transfer(rx, proxy, state)
            _offer_again(rx, proxy, transfer, state, _partials.UNKNOWN)
    finally:
        rx.close()


def _hostile(monkeypatch: pytest.MonkeyPatch, body: Callable[[list[wire.Transfer]], bytes]) -> None:
    """Rank 1's handshake writes ``body`` as its resume offer (rank 0's is untouched)."""
    real = _handshake.exchange_offers

    def exchange(channel: Any, offers: Any, partials: Any, peer_offers: bool,
                 **kwargs: Any) -> None:
        if channel.rank != 1:
            return real(channel, offers, partials, peer_offers, **kwargs)
        _resume._write_control(channel, body(list(offers)))
        channel.recv(timeout=10)  # the receiver refuses: the connection closes
    monkeypatch.setattr(_handshake, "exchange_offers", exchange)


def _entry(transfer: wire.Transfer, **change: int) -> bytes:
    fields = {"total": transfer.encoded.nbytes, "count": transfer.count, "size": transfer.size}
    fields.update(change)
    return wire.RESUME_OFFER.pack(transfer.id, transfer.digest(), fields["total"],
                                  fields["count"], fields["size"])


HOSTILE = {
    "count-claims-more": (lambda ts: wire.RESUME_COUNT.pack(3, 0) + _entry(ts[0]),
                          "claims 3 transfers in 56 bytes"),
    "over-max-offers": (lambda ts: wire.RESUME_COUNT.pack(65, 0) + _entry(ts[0]) * 65,
                        "at most 64"),
    "segment-size-0": (lambda ts: wire.RESUME_COUNT.pack(1, 0) + _entry(ts[0], size=0),
                       "announced segments of 0 bytes"),
    "segment-over-max-frame": (lambda ts: wire.RESUME_COUNT.pack(1, 0)
                               + _entry(ts[0], size=(1 << 30) + 1), "its max_frame"),
    "message-over-max-message": (lambda ts: wire.RESUME_COUNT.pack(1, 0)
                                 + _entry(ts[0], total=1 << 41, count=(1 << 41) // SEGMENT),
                                 "above this node's max_message"),
    "count-not-the-layout": (lambda ts: wire.RESUME_COUNT.pack(1, 0) + _entry(ts[0], count=5),
                             "announced 5 segments"),
    "same-id-twice": (lambda ts: wire.RESUME_COUNT.pack(2, 0) + _entry(ts[0]) * 2,
                      "names a transfer twice"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_offer_is_a_specific_error_and_the_receiver_keeps_serving(
        receiver, monkeypatch, case):
    state = _contribution(1 << 20)
    body, message = HOSTILE[case]
    with CuttingProxy(receiver.address, cuts=[2 << 20]) as proxy:
        transfer = _cut_transfer(receiver, proxy, state)
        kept = receiver.store.nbytes
        with monkeypatch.context() as patch:
            _hostile(patch, body)
            accepting = Call(receiver.accept, "receiver")
            with pytest.raises(PeerLostError):
                _dial(proxy, offers=[transfer])
            with pytest.raises(WireError, match=message):
                accepting.result(10)
        assert receiver.store.nbytes == kept  # the partial is still there for its sender
        # No crash: the real sender resumes on the next connection.
        receiving = receiver.receive()
        channel = _dial(proxy, offers=[transfer])
        assert channel.resume_answers[transfer.id].status == _partials.RESUMED
        channel.send_resumable(3, 9, transfer)
        _equal(receiving.result(30), state)
        channel.close()


def test_a_partial_claimed_by_a_connection_lost_before_its_continuation_is_kept(receiver):
    state = _contribution(1 << 20)
    with CuttingProxy(receiver.address, cuts=[2 << 20]) as proxy:
        transfer = _cut_transfer(receiver, proxy, state)
        receiving = receiver.receive()
        channel = _dial(proxy, offers=[transfer])
        first = channel.resume_answers[transfer.id].first
        assert first > 0 and len(receiver.store) == 0  # claimed by that connection
        channel.close()  # lost before it sent the rest
        with pytest.raises(PeerLostError):
            receiving.result(30)
        assert transfer.id in receiver.store  # back for the next attempt
        receiving = receiver.receive()
        channel = _dial(proxy, offers=[transfer])
        assert channel.resume_answers[transfer.id].first == first
        channel.send_resumable(3, 9, transfer)
        _equal(receiving.result(30), state)
        channel.close()


def test_a_continuation_from_a_segment_not_answered_is_refused(receiver):
    state = _contribution(1 << 20)
    with CuttingProxy(receiver.address, cuts=[2 << 20]) as proxy:
        transfer = _cut_transfer(receiver, proxy, state)
        receiving = receiver.receive()
        channel = _dial(proxy, offers=[transfer])
        answer = channel.resume_answers[transfer.id]
        answer.first += 1  # the sender skips a segment the receiver does not have
        try:
            channel.send_resumable(3, 9, transfer)
        except PeerLostError:
            pass
        with pytest.raises(WireError, match=f"from segment {answer.first}, but this "
                                            f"connection's handshake answered it with segment "
                                            f"{answer.first - 1}"):
            receiving.result(30)
        channel.close()


def test_both_ends_may_offer_in_one_handshake_and_each_gets_its_answer(receiver):
    mine = wire.Transfer.of(_contribution(1 << 18))
    theirs = wire.Transfer.of(_contribution(1 << 18))
    mine.size = theirs.size = SEGMENT  # as if each had been cut before
    receiver.kwargs["offers"] = [theirs]
    accepting = Call(receiver.accept, "receiver")
    channel = wire.handshake(socket.create_connection(receiver.address, timeout=10), SECRET,
                             rank=1, world=2, timeout=10.0, segment=SEGMENT, offers=[mine])
    other = accepting.result(10)
    assert channel.resume_answers[mine.id].status == _partials.UNKNOWN
    assert other.resume_answers[theirs.id].status == _partials.UNKNOWN
    # The stream is in step after the exchange: a message each way.
    channel.send(1, 2, {"x": 1})
    assert other.recv(timeout=10).state == {"x": 1}
    other.send(1, 2, {"y": 2})
    assert channel.recv(timeout=10).state == {"y": 2}
    channel.close()


def test_a_transfer_the_receiver_completed_is_not_sent_twice(receiver):
    state = _contribution(1 << 20)
    with CuttingProxy(receiver.address) as proxy:
        receiving = receiver.receive()
        channel = _dial(proxy)
        transfer = wire.Transfer.of(state)
        channel.send_resumable(3, 9, transfer)
        _equal(receiving.result(30), state)
        channel.close()
        # The sender cannot tell whether the end arrived: it offers the transfer again.
        receiving = receiver.receive()
        channel = _dial(proxy, offers=[transfer])
        answer = channel.resume_answers[transfer.id]
        assert (answer.status, answer.first) == (_partials.COMPLETED, 0)
        assert "not to be sent again" in answer.reason
        assert channel.send_resumable(3, 9, transfer) == 0
        channel.send(3, 10, {"next": 1})
        frame = receiving.result(30)
        assert (frame.tag, frame.state) == (10, {"next": 1})  # nothing came before it
        channel.close()


def test_a_message_of_one_segment_is_an_ordinary_frame(receiver):
    receiving = receiver.receive()
    with CuttingProxy(receiver.address) as proxy:
        channel = _dial(proxy)
        transfer = wire.Transfer.of({"x": np.arange(10.0)})
        channel.send_resumable(3, 9, transfer)
        frame = receiving.result(10)
        assert frame.segments == 0 and not transfer.offerable()
        channel.close()


def test_a_resumable_lead_without_segments_flag_is_refused(pair):
    a, b = pair
    a._write_frame(3, wire.FLAG_RESUMABLE, 9, 0, [memoryview(bytes(8))], 8, None)
    with pytest.raises(WireError, match="unknown flags 0x8"):
        b.recv(timeout=10)


def _answer(transfer: wire.Transfer, first: int, status: int, tid: bytes | None = None) -> bytes:
    return wire.RESUME_ANSWER.pack(transfer.id if tid is None else tid, first, status)


HOSTILE_ANSWERS = {
    "no-entry": (lambda t: wire.RESUME_COUNT.pack(0, 0), "answers 0 transfers, 1 were offered"),
    "past-the-end": (lambda t: wire.RESUME_COUNT.pack(1, 0) + _answer(t, t.count, 0),
                     "is not an answer"),
    "resumed-at-0": (lambda t: wire.RESUME_COUNT.pack(1, 0) + _answer(t, 0, 0),
                     "is not an answer"),
    "unknown-status": (lambda t: wire.RESUME_COUNT.pack(1, 0) + _answer(t, 0, 99),
                       "is not an answer"),
    "another-id": (lambda t: wire.RESUME_COUNT.pack(1, 0) + _answer(t, 1, 0, bytes(16)),
                   "is not an answer"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_ANSWERS))
def test_a_hostile_answer_is_a_specific_error_for_the_sender(receiver, monkeypatch, case):
    body, message = HOSTILE_ANSWERS[case]
    transfer = wire.Transfer.of(_contribution(1 << 18))
    transfer.size = SEGMENT  # as if it had been cut before
    real = _handshake.exchange_offers

    def exchange(channel: Any, offers: Any, partials: Any, peer_offers: bool,
                 **kwargs: Any) -> None:
        if channel.rank != 0:
            return real(channel, offers, partials, peer_offers, **kwargs)
        _resume._read_offer(channel)
        _resume._write_control(channel, body(transfer))
    monkeypatch.setattr(_handshake, "exchange_offers", exchange)
    accepting = Call(receiver.accept, "receiver")
    with pytest.raises(WireError, match=message):
        wire.handshake(socket.create_connection(receiver.address, timeout=10), SECRET, rank=1,
                       world=2, timeout=10.0, segment=SEGMENT, offers=[transfer])
    accepting.result(10).close()


def test_a_transfer_resumes_with_encryption_off_too():
    rx = Receiver(wire.PartialStore(), encrypt=False)
    state = _contribution(1 << 20)
    try:
        with CuttingProxy(rx.address, cuts=[2 << 20]) as proxy:
            receiving = rx.receive()
            channel = _dial(proxy, encrypt=False)
            transfer = wire.Transfer.of(state)
            try:
                channel.send_resumable(3, 9, transfer)
            except PeerLostError:
                pass
            with pytest.raises(PeerLostError):
                receiving.result(30)
            receiving = rx.receive()
            channel = _dial(proxy, encrypt=False, offers=[transfer])
            assert not channel.encrypted and channel.resume_answers[transfer.id].first > 0
            channel.send_resumable(3, 9, transfer)
            _equal(receiving.result(30), state)
            channel.close()
    finally:
        rx.close()
