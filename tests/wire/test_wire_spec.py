"""docs/wire.md is enough to write a peer: one built from it alone interoperates."""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import struct

import numpy as np
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from meshkit import wire

from test_channel import SECRET, Outcome, tcp_pair


class DocPeer:
    """A peer written only from docs/wire.md (struct, hmac and AESGCM; no meshkit.wire)."""

    def __init__(self, sock: socket.socket, secret: bytes, rank: int, world: int) -> None:
        import os

        self.sock = sock
        nonce = os.urandom(32)
        mine = struct.pack("<8sHHHHIIQ16s32s", b"MESHKIT\0", 2, 0, 0, 0, rank, world, 1 << 30,
                           bytes(16), nonce)
        sock.sendall(mine)
        theirs = self._read(80)
        a, b = sorted((mine, theirs))
        transcript = hashlib.sha256(b"meshkit/1 transcript" + a + b).digest()
        prk = hmac.digest(transcript, secret, "sha256")

        def key(label: bytes, n: bytes) -> bytes:
            return hmac.digest(prk, b"meshkit/1 " + label + b" " + n + b"\x01", "sha256")

        peer_nonce = theirs[48:80]
        self.send_keys = (key(b"header", nonce), AESGCM(key(b"body-gmac", nonce)))
        self.recv_keys = (key(b"header", peer_nonce), AESGCM(key(b"body-gmac", peer_nonce)))
        sock.sendall(hmac.digest(key(b"confirm", nonce), transcript, "sha256"))
        assert self._read(32) == hmac.digest(key(b"confirm", peer_nonce), transcript, "sha256")
        self.seq_out = self.seq_in = 0

    def _read(self, n: int) -> bytes:
        return self.sock.recv(n, socket.MSG_WAITALL)

    def send_array(self, tag: int, name: str, array: np.ndarray, code: int) -> None:
        raw = name.encode()
        table = struct.pack("<II", 1, 0) + struct.pack("<BBBBIQ", 1, code, array.ndim, 0,
                                                        len(raw), array.nbytes)
        table += b"".join(struct.pack("<Q", d) for d in array.shape) + raw
        table += bytes(-len(table) % 64)
        body = table + array.astype(array.dtype.newbyteorder("<")).tobytes()
        head = struct.pack("<4sBBHIIQQ", b"MKF\x01", 9, 0, 0, tag, 1, self.seq_out, len(body))
        header = head + hmac.digest(self.send_keys[0], head, "sha256")
        nonce = struct.pack("<IQ", 0, self.seq_out)
        tag_ = self.send_keys[1].encrypt(nonce, header, body)[-16:]
        self.sock.sendall(header + body + tag_)
        self.seq_out += 1

    def recv_json(self) -> tuple[int, dict]:
        header = self._read(64)
        assert hmac.compare_digest(header[32:], hmac.digest(self.recv_keys[0], header[:32],
                                                            "sha256"))
        magic, kind, flags, _, tag, sender, seq, body_len = struct.unpack("<4sBBHIIQQ",
                                                                          header[:32])
        assert (magic, seq) == (b"MKF\x01", self.seq_in)
        body = self._read(body_len)
        tag_ = self._read(16)
        nonce = struct.pack("<IQ", 0, self.seq_in)
        assert hmac.compare_digest(tag_, self.recv_keys[1].encrypt(nonce, header, body)[-16:])
        self.seq_in += 1
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


def test_a_peer_written_from_the_docs_interoperates():
    a, b = tcp_pair()
    other = Outcome(lambda: wire.handshake(b, SECRET, rank=0, world=3))
    peer = DocPeer(a, SECRET, rank=1, world=3)
    channel = other.get()
    assert channel.peer.rank == 1
    matrix = np.arange(6, dtype=np.float32).reshape(2, 3)
    peer.send_array(11, "w", matrix, code=12)
    frame = channel.recv()
    assert (frame.kind, frame.tag, frame.sender) == (9, 11, 1)
    np.testing.assert_array_equal(frame.state["w"], matrix)
    channel.send(3, 12, {"round": 4, "names": ["a", "b"], "loss": 0.5})
    assert peer.recv_json() == (12, {"round": 4, "names": ["a", "b"], "loss": 0.5})
    channel.close()
    a.close()
