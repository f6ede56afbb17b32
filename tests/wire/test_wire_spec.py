"""docs/wire.md is enough to write a peer: one built from it alone interoperates."""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import struct

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from meshkit import wire
from meshkit.errors import PeerLostError
from meshkit.testing.support import Call

from tests.support.channels import SECRET, tcp_pair
class DocPeer:
    """A peer written only from docs/wire.md (struct, hmac, AESGCM, X25519 and
    Ed25519 from ``cryptography``; no meshkit.wire)."""

    def __init__(self, sock: socket.socket, secret: bytes, rank: int, world: int, *,
                 encrypt: bool = True, node_key: Ed25519PrivateKey | None = None,
                 segment_units: int = 64, offer: bytes = b"") -> None:
        self.sock = sock
        self.encrypt = encrypt
        ephemeral = X25519PrivateKey.generate()
        nonce = ephemeral.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        flags = ((0 if encrypt else 0x0002) | (0x0004 if node_key is not None else 0)
                 | (0x0008 if offer else 0))
        mine = struct.pack("<8sHHHHIIQ16s32s", b"MESHKIT\0", 5, flags, 0, segment_units, rank,
                           world, 1 << 30, bytes(16), nonce)
        sock.sendall(mine)
        theirs = self._read(80)
        peer_nonce = theirs[48:80]
        shared = ephemeral.exchange(X25519PublicKey.from_public_bytes(peer_nonce))
        a, b = sorted((mine, theirs))
        transcript = hashlib.sha256(b"meshkit/1 transcript" + a + b).digest()
        prk = hmac.digest(transcript, secret + shared, "sha256")

        def key(label: bytes, n: bytes) -> bytes:
            return hmac.digest(prk, b"meshkit/1 " + label + b" " + n + b"\x01", "sha256")

        self.send_keys = (key(b"header", nonce), AESGCM(key(b"body", nonce)))
        self.recv_keys = (key(b"header", peer_nonce), AESGCM(key(b"body", peer_nonce)))
        sock.sendall(hmac.digest(key(b"confirm", nonce), transcript, "sha256"))
        assert self._read(32) == hmac.digest(key(b"confirm", peer_nonce), transcript, "sha256")
        if node_key is not None:
            public = node_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
            sock.sendall(public + node_key.sign(b"meshkit/1 node identity " + transcript + nonce))
        self.seq_out = self.seq_in = 0
        # wire.md §2.4: the link cuts at the smaller of the two hellos' segment sizes.
        self.segment = min(segment_units, struct.unpack_from("<H", theirs, 14)[0]) * 65536
        self.answer = b""
        if offer:  # wire.md §1.2 step 9: the offer, then (the peer offers nothing) its answer
            self._send_frame(0, 0x10, offer, kind=0)
            flags_, _, self.answer = self._recv_frame()
            assert flags_ == 0x10

    def _read(self, n: int) -> bytes:
        out = b""
        while len(out) < n:  # a socket with a timeout returns what has arrived
            chunk = self.sock.recv(n - len(out), socket.MSG_WAITALL)
            if not chunk:
                break
            out += chunk
        return out

    def send_array(self, tag: int, name: str, array: np.ndarray, code: int) -> None:
        raw = name.encode()
        table = struct.pack("<II", 1, 0) + struct.pack("<BBBBIQ", 1, code, array.ndim, 0,
                                                        len(raw), array.nbytes)
        table += b"".join(struct.pack("<Q", d) for d in array.shape) + raw
        table += bytes(-len(table) % 64)
        body = table + array.astype(array.dtype.newbyteorder("<")).tobytes()
        if len(body) <= self.segment:
            self._send_frame(tag, 0, body)
            return
        count = -(-len(body) // self.segment)
        self._send_frame(tag, 0x02, struct.pack("<QII", len(body), count, self.segment))
        for i in range(count):
            self._send_frame(tag, 0x04, body[i * self.segment:(i + 1) * self.segment])

    def _send_frame(self, tag: int, flags: int, body: bytes, kind: int = 9) -> None:
        head = struct.pack("<4sBBHIIQQ", b"MKF\x01", kind, flags, 0, tag, 1, self.seq_out,
                           len(body))
        header = head + hmac.digest(self.send_keys[0], head, "sha256")
        nonce = struct.pack("<IQ", 0, self.seq_out)
        if self.encrypt:
            sealed = self.send_keys[1].encrypt(nonce, body, header)
        else:
            sealed = body + self.send_keys[1].encrypt(nonce, header, body)[-16:]
        self.sock.sendall(header + sealed)
        self.seq_out += 1

    def recv_body(self) -> tuple[int, bytes]:
        """The next message's tag and body: one frame, or a lead and its segments."""
        flags, tag, body = self._recv_frame()
        if not flags & 0x02:
            return tag, body
        total, count, size = struct.unpack("<QII", body)
        parts = []
        for i in range(count):
            s_flags, s_tag, part = self._recv_frame()
            assert (s_flags, s_tag, len(part)) == (0x04, tag, min(size, total - i * size))
            parts.append(part)
        return tag, b"".join(parts)

    def _recv_frame(self) -> tuple[int, int, bytes]:
        header = self._read(64)
        assert hmac.compare_digest(header[32:], hmac.digest(self.recv_keys[0], header[:32],
                                                            "sha256"))
        magic, kind, flags, _, tag, sender, seq, body_len = struct.unpack("<4sBBHIIQQ",
                                                                          header[:32])
        assert (magic, seq) == (b"MKF\x01", self.seq_in)
        body = self._read(body_len)
        tag_ = self._read(16)
        nonce = struct.pack("<IQ", 0, self.seq_in)
        if self.encrypt:
            body = self.recv_keys[1].decrypt(nonce, body + tag_, header)
        else:
            assert hmac.compare_digest(tag_, self.recv_keys[1].encrypt(nonce, header, body)[-16:])
        self.seq_in += 1
        return flags, tag, body

    def recv_json(self) -> tuple[int, dict]:
        tag, body = self.recv_body()
        count, _ = struct.unpack_from("<II", body)
        pos, entries = 8, []
        for _ in range(count):
            kind_, code, ndim, eflags, name_len, data_len = struct.unpack_from("<BBBBIQ", body, pos)
            pos += 16 + 8 * ndim
            entries.append((body[pos:pos + name_len].decode(), kind_, data_len))
            pos += name_len
        out, offset = {}, -(-pos // 64) * 64
        for name, kind_, data_len in entries:
            assert kind_ == 2
            out[name] = json.loads(body[offset:offset + data_len])
            offset = -(-(offset + data_len) // 64) * 64
        return tag, out


@pytest.mark.parametrize("encrypt", [True, False], ids=["encrypted", "authenticated"])
def test_a_peer_written_from_the_docs_interoperates(encrypt):
    a, b = tcp_pair()
    node_key = Ed25519PrivateKey.generate()
    other = Call(lambda: wire.handshake(b, SECRET, rank=0, world=3, encrypt=encrypt))
    peer = DocPeer(a, SECRET, rank=1, world=3, encrypt=encrypt, node_key=node_key)
    channel = other.result()
    assert channel.peer.rank == 1 and channel.encrypted is encrypt
    assert channel.peer_key == node_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    matrix = np.arange(6, dtype=np.float32).reshape(2, 3)
    peer.send_array(11, "w", matrix, code=12)
    frame = channel.recv()
    assert (frame.kind, frame.tag, frame.sender) == (9, 11, 1)
    np.testing.assert_array_equal(frame.state["w"], matrix)
    channel.send(3, 12, {"round": 4, "names": ["a", "b"], "loss": 0.5})
    assert peer.recv_json() == (12, {"round": 4, "names": ["a", "b"], "loss": 0.5})
    channel.close()
    a.close()


@pytest.mark.parametrize("encrypt", [True, False], ids=["encrypted", "authenticated"])
def test_a_peer_written_from_the_docs_sends_and_receives_segments(encrypt):
    a, b = tcp_pair()
    # The channel asks for 4 MiB segments, the doc peer for 64 KiB: 64 KiB both ways.
    other = Call(lambda: wire.handshake(b, SECRET, rank=0, world=2, encrypt=encrypt))
    peer = DocPeer(a, SECRET, rank=1, world=2, encrypt=encrypt, segment_units=1)
    channel = other.result()
    assert channel.segment_bytes == peer.segment == 65536
    big = np.arange(100_000, dtype=np.float32)  # 400 kB: 7 segments
    sending = Call(lambda: peer.send_array(11, "w", big, code=12))
    frame = channel.recv()
    sending.result()
    assert frame.segments == 7
    np.testing.assert_array_equal(frame.state["w"], big)
    text = ["x" * 1000] * 300  # a 300 kB JSON value
    sending = Call(lambda: channel.send(3, 12, {"notes": text}))
    assert peer.recv_json() == (12, {"notes": text})
    sending.result()
    channel.close()
    a.close()


def _table(name: str, array: np.ndarray, code: int) -> bytes:
    raw = name.encode()
    table = struct.pack("<II", 1, 0) + struct.pack("<BBBBIQ", 1, code, array.ndim, 0, len(raw),
                                                    array.nbytes)
    table += b"".join(struct.pack("<Q", d) for d in array.shape) + raw
    return table + bytes(-len(table) % 64) + array.astype("<f4").tobytes()


def test_a_peer_written_from_the_docs_resumes_a_cut_transfer():
    """wire.md §2.5 alone: a resumable lead, the cut, the offer (with its digest), the answer,
    the continuation; the meshkit end receives the whole body."""
    store = wire.PartialStore()
    big = np.arange(100_000, dtype=np.float32)  # 400 kB: 7 segments of 64 KiB
    body = _table("w", big, 12)
    size, transfer_id = 65536, bytes(range(16))
    count = -(-len(body) // size)

    def lead(first: int) -> bytes:
        return struct.pack("<QII16sII", len(body), count, size, transfer_id, first, 0)

    a, b = tcp_pair()
    other = Call(lambda: wire.handshake(b, SECRET, rank=0, world=2, partials=store))
    peer = DocPeer(a, SECRET, rank=1, world=2, segment_units=1)
    channel = other.result()
    receiving = Call(channel.recv)
    peer._send_frame(11, 0x02 | 0x08, lead(0))
    for i in range(3):  # three segments, then the connection is cut
        peer._send_frame(11, 0x04, body[i * size:(i + 1) * size])
    a.close()
    with pytest.raises(PeerLostError):
        receiving.result()
    assert transfer_id in store

    gmac_key = hashlib.sha256(b"meshkit/5 resume digest" + transfer_id).digest()
    digest = AESGCM(gmac_key).encrypt(bytes(12), b"", body)[-16:]
    offer = struct.pack("<II", 1, 0) + struct.pack("<16s16sQII", transfer_id, digest, len(body),
                                                   count, size)
    a, b = tcp_pair()
    other = Call(lambda: wire.handshake(b, SECRET, rank=0, world=2, partials=store))
    peer = DocPeer(a, SECRET, rank=1, world=2, segment_units=1, offer=offer)
    channel = other.result()
    n, reserved = struct.unpack_from("<II", peer.answer)
    tid, first, status = struct.unpack_from("<16sII", peer.answer, 8)
    assert (n, reserved, tid, first, status) == (1, 0, transfer_id, 3, 0)
    receiving = Call(channel.recv)
    peer._send_frame(11, 0x02 | 0x08, lead(first))
    for i in range(first, count):
        peer._send_frame(11, 0x04, body[i * size:(i + 1) * size])
    frame = receiving.result()
    assert frame.resumed_from == 3 and frame.segments == count - 3
    np.testing.assert_array_equal(frame.state["w"], big)
    channel.close()
    a.close()
