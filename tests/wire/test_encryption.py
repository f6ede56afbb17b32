"""Frame bodies are AES-256-GCM encrypted by default; ``encrypt=False`` is agreed or refused."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from meshkit import wire
from meshkit.errors import AuthenticationError, WireError
from meshkit.testing.support import Call

from tests.support.channels import SECRET, channel_pair, record, send_raw, tcp_pair
def test_encryption_is_the_default_and_round_trips_every_size():
    a, b = channel_pair()
    assert a.encrypted and b.encrypted
    for n in (0, 1, 1000, 70_000, 300_000, 3 << 20):
        state = {"weights": np.arange(n, dtype=np.float32), "meta": {"n": n}}
        sending = Call(lambda: a.send(1, 5, state))
        frame = b.recv()
        sending.result()
        np.testing.assert_array_equal(frame.state["weights"], state["weights"])
        assert frame.state["meta"] == {"n": n}
        frame.state["weights"][:1] = 7  # decrypted in place into a writable buffer
    a.close(), b.close()


def test_scattered_buffers_are_encrypted_as_one_body():
    a, b = channel_pair()
    state = {f"layer{i}": np.full(100_000 + i, i, dtype=np.float32) for i in range(4)}
    state["small"] = np.ones(3)
    sending = Call(lambda: a.send_encoded(1, 2, wire.encode_state(state)))
    frame = b.recv(timeout=10)
    sending.result()
    for key, value in state.items():
        np.testing.assert_array_equal(frame.state[key], value)
    a.close(), b.close()


@pytest.mark.parametrize("first", [True, False], ids=["dialer-encrypts", "dialer-in-clear"])
def test_an_encryption_mismatch_is_a_clear_error_on_both_ends(first):
    a, b = tcp_pair()
    other = Call(lambda: wire.handshake(b, SECRET, rank=1, world=2, encrypt=not first))
    with pytest.raises(WireError, match="frame encryption .*`\\[mesh\\] encrypt` the same"):
        wire.handshake(a, SECRET, rank=0, world=2, encrypt=first)
    with pytest.raises(WireError, match="frame encryption .*`\\[mesh\\] encrypt` the same"):
        other.result()


@pytest.mark.parametrize("n", [64, 1 << 20], ids=["small", "large"])
def test_a_flipped_ciphertext_bit_is_refused_before_anything_is_decoded(n):
    a, b = channel_pair()
    (frame,) = record(a, (1, 1, {"x": np.zeros(n, dtype=np.uint8)}))
    tampered = bytearray(frame)
    tampered[wire.HEADER_SIZE + 10] ^= 1
    writing = Call(lambda: send_raw(a, bytes(tampered)))
    with pytest.raises(AuthenticationError, match="body .* failed authentication"):
        b.recv()
    writing.result()
    assert b.closed
    a.close()


def test_the_same_state_never_travels_as_the_same_ciphertext():
    a, b = channel_pair()
    state = {"x": np.arange(64, dtype=np.float32)}
    first, second = record(a, (1, 1, state), (1, 1, state))
    assert first[wire.HEADER_SIZE:] != second[wire.HEADER_SIZE:]
    assert state["x"].tobytes() not in first
    a.close(), b.close()


def test_node_keys_are_proven_and_reported_and_a_forged_proof_is_refused(tmp_path):
    wire.generate_node_key(tmp_path / "k")
    key = wire.load_node_key(tmp_path / "k")
    a, b = channel_pair(node_key=key)
    assert a.peer_key == b.peer_key == key.public
    a.close(), b.close()
    plain_a, plain_b = channel_pair()
    assert plain_a.peer_key is None
    plain_a.close(), plain_b.close()

    class Forger(wire.NodeKey):
        def sign(self, transcript: bytes, nonce: bytes) -> bytes:
            return super().sign(transcript, bytes(32))  # a signature for another handshake

    x, y = tcp_pair()
    other = Call(lambda: wire.handshake(y, SECRET, rank=1, world=2))
    forging = Call(lambda: wire.handshake(x, SECRET, rank=0, world=2,
                                          node_key=Forger(key.private)))
    with pytest.raises(AuthenticationError, match="failed to prove possession"):
        other.result()
    with pytest.raises(Exception):
        forging.result().recv(timeout=5)


class _Sink:
    """Stands in for a socket that takes every byte and keeps none."""

    def send(self, view) -> int:
        return len(view)


def _peak_bytes(action) -> int:
    tracemalloc.start()
    try:
        action()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _peak_of_a_small_send(channel, n: int) -> int:
    """The bytes allocated at the peak of sending an ``n``-byte state (not the first)."""
    # Two entries: the codec lays a small frame out as one buffer (a lone
    # array is two, joined before sealing).
    encoded = wire.encode_state({"x": np.arange(n // 4, dtype=np.float32), "round": 1})
    real, channel._sock = channel._sock, _Sink()
    try:
        channel.send_encoded(1, 1, encoded)  # the thread's buffer is made once
        return _peak_bytes(lambda: channel.send_encoded(1, 1, encoded))
    finally:
        channel._sock = real


def test_a_small_frame_is_sealed_and_opened_without_a_second_copy_of_its_body():
    # 32 KiB: a small frame (one AEAD call), under the receive pool's sizes.
    a, b = channel_pair()
    n = 32 << 10
    # Sealed into the thread's buffer and sent from it: no body-sized
    # allocation. It was two (the ciphertext, then header + ciphertext).
    assert _peak_of_a_small_send(a, n) < n // 4

    warm, frame = record(a, (1, 1, {"x": np.zeros(n // 4, dtype=np.float32)}),
                         (1, 1, {"x": np.arange(n // 4, dtype=np.float32)}))
    b._recv_seq = a._send_seq - 2  # the two sink frames never reached b
    for raw in (warm, frame):
        writing = Call(lambda: send_raw(a, raw))
        got = []
        peak = _peak_bytes(lambda: got.append(b.recv()))
        writing.result()
    np.testing.assert_array_equal(got[0].state["x"], np.arange(n // 4, dtype=np.float32))
    # The frame's own buffer, and nothing else body-sized: the ciphertext is
    # read into the thread's buffer (opening it in place is not allowed).
    assert peak < n * 3 // 2
    a.close(), b.close()


def test_the_kept_buffer_and_the_fallback_send_the_same_bytes(monkeypatch):
    # Releases without encrypt_into/decrypt_into (cryptography < 46) copy
    # instead; the frame on the wire is the same either way.
    from meshkit.wire import _channel

    a, b = channel_pair()
    state = {"x": np.arange(1000, dtype=np.float32), "meta": {"k": 1}}
    seq = a._send_seq
    (kept,) = record(a, (1, 3, state))
    a._send_seq = seq  # the same nonce, only to compare the bytes
    monkeypatch.setattr(_channel, "_AEAD_INTO", False)
    (copied,) = record(a, (1, 3, state))
    assert kept == copied
    b._recv_seq = a._send_seq
    for n in (0, 1000, 70_000):
        sending = Call(lambda: a.send(1, 5, {"w": np.full(n, 3, dtype=np.uint8)}))
        got = b.recv()
        sending.result()
        np.testing.assert_array_equal(got.state["w"], np.full(n, 3, dtype=np.uint8))
    a.close(), b.close()


def test_threads_seal_and_open_small_frames_at_once_each_in_its_own_buffer():
    pairs = [channel_pair() for _ in range(4)]

    def talk(i: int) -> None:
        a, b = pairs[i]
        for k in range(40):
            state = {"x": np.full(500 + 97 * k + i, i * 1000 + k, dtype=np.int32)}
            sending = Call(lambda: a.send(1, k, state))
            got = b.recv(timeout=10)
            sending.result()
            np.testing.assert_array_equal(got.state["x"], state["x"])

    talkers = [Call(lambda i=i: talk(i)) for i in range(4)]
    for talker in talkers:
        talker.result()
    for a, b in pairs:
        a.close(), b.close()


def test_an_unencrypted_small_frame_is_its_body_in_clear_and_its_gmac_tag():
    # [mesh] encrypt = false: the body travels as it is, tagged with AES-GCM over an
    # empty plaintext (the header encrypted, the body as associated data).
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    a, b = channel_pair(encrypt=False)
    assert not a.encrypted
    state = {"x": np.arange(1000, dtype=np.float32), "op": "fit"}
    seq = a._send_seq
    (frame,) = record(a, (1, 4, state))
    body = b"".join(memoryview(buf).cast("B") for buf in wire.encode_state(state).buffers)
    header = frame[:wire.HEADER_SIZE]
    assert frame[wire.HEADER_SIZE:-16] == body
    nonce = (0).to_bytes(4, "little") + seq.to_bytes(8, "little")
    assert frame[-16:] == AESGCM(a._keys.send_body).encrypt(nonce, header, body)[-16:]
    b._recv_seq = a._send_seq  # the recorded frame never reached b
    for n in (0, 1000, 70_000):  # the thread's kept buffer and a fresh one
        sending = Call(lambda: a.send(1, 5, {"w": np.full(n, 7, dtype=np.uint8), "k": n}))
        got = b.recv()
        sending.result()
        np.testing.assert_array_equal(got.state["w"], np.full(n, 7, dtype=np.uint8))
        assert got.state["k"] == n
    a.close(), b.close()


def test_an_unencrypted_small_frame_is_built_without_a_body_sized_allocation():
    a, b = channel_pair(encrypt=False)
    n = 32 << 10
    # It was a bytearray grown to header + body + tag.
    assert _peak_of_a_small_send(a, n) < n // 4
    a.close(), b.close()
