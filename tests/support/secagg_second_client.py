"""A second SecAgg+ client, written from docs/protocol.md §7.2 and docs/secure-aggregation.md only.

Independent of ``meshkit_secagg`` on purpose (no import of it): primitives
from ``hashlib``, ``hmac`` and ``cryptography`` (X25519, AES-GCM), the
ChaCha20 block function written out from RFC 8439. It exists to prove that
the documented byte layouts are enough to take part in a round
(tests/plugins/meshkit_secagg/test_second_client.py): it reproduces the test
vectors, and it plays clients in a round with the plugin's own clients and
coordinator.

Its randomness comes from ``draw(label, size)``: ``os.urandom`` for a live
client, :func:`vector_draw` for the test vectors (docs/protocol.md,
"Test vectors").
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from typing import Callable, Mapping, Sequence

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

P = (1 << 521) - 1
LABEL = b"meshkit/secagg/1 "
SHARE_BYTES = 70  # x: 4 bytes big-endian, y: 66 bytes big-endian
SEALED_BYTES = 32 + 12 + 2 * SHARE_BYTES + 16
Draw = Callable[[bytes, int], bytes]


def live_draw(label: bytes, size: int) -> bytes:
    return os.urandom(size)


def vector_draw(label: bytes, size: int) -> bytes:
    """The test vectors' randomness: SHA-512 of the vectors' prefix and the label, cut to ``size``."""
    return hashlib.sha512(b"meshkit/secagg/vectors " + label).digest()[:size]


def i64(value: int) -> bytes:
    return value.to_bytes(8, "big", signed=True)


def x25519_public(private: bytes) -> bytes:
    return X25519PrivateKey.from_private_bytes(private).public_key().public_bytes_raw()


def x25519(private: bytes, public: bytes) -> bytes:
    return X25519PrivateKey.from_private_bytes(private).exchange(
        X25519PublicKey.from_public_bytes(public))


def hkdf(shared: bytes, round_seed: bytes, purpose: bytes, a: int, b: int) -> bytes:
    lo, hi = sorted((a, b))
    prk = hmac.digest(round_seed, shared, "sha256")
    info = LABEL + purpose + b" " + i64(lo) + i64(hi)
    return hmac.digest(prk, info + b"\x01", "sha256")


def commitment(seed: bytes, round_seed: bytes, client: int) -> bytes:
    return hashlib.sha256(LABEL + b"self-mask commitment " + round_seed + i64(client)
                          + seed).digest()


def aad(round_seed: bytes, sender: int, recipient: int) -> bytes:
    return LABEL + b"shares " + round_seed + i64(sender) + i64(recipient)


def ring_key(round_seed: bytes, member: int) -> bytes:
    return hashlib.sha256(b"meshkit/secagg graph " + round_seed + i64(member)).digest()


def graph(round_seed: bytes, members: Sequence[int], degree: int) -> dict[int, list[int]]:
    ids = sorted(members)
    k = degree + degree % 2
    if degree == 0 or k >= len(ids) - 1:
        return {m: [o for o in ids if o != m] for m in ids}
    ring = sorted(ids, key=lambda m: (ring_key(round_seed, m), m))
    n, half = len(ring), k // 2
    return {m: sorted({ring[(i + s) % n] for s in range(-half, half + 1) if s})
            for i, m in enumerate(ring)}


def _quarter(s: list[int], a: int, b: int, c: int, d: int) -> None:
    m = 0xFFFFFFFF
    s[a] = (s[a] + s[b]) & m; s[d] ^= s[a]; s[d] = ((s[d] << 16) | (s[d] >> 16)) & m
    s[c] = (s[c] + s[d]) & m; s[b] ^= s[c]; s[b] = ((s[b] << 12) | (s[b] >> 20)) & m
    s[a] = (s[a] + s[b]) & m; s[d] ^= s[a]; s[d] = ((s[d] << 8) | (s[d] >> 24)) & m
    s[c] = (s[c] + s[d]) & m; s[b] ^= s[c]; s[b] = ((s[b] << 7) | (s[b] >> 25)) & m


def chacha20_keystream(key: bytes, size: int) -> bytes:
    """RFC 8439 §2.3 blocks, counter from 0, nonce all zero."""
    out = bytearray()
    words = list(struct.unpack("<8I", key))
    counter = 0
    while len(out) < size:
        state = [0x61707865, 0x3320646E, 0x79622D32, 0x6B206574, *words, counter, 0, 0, 0]
        s = list(state)
        for _ in range(10):
            _quarter(s, 0, 4, 8, 12); _quarter(s, 1, 5, 9, 13)
            _quarter(s, 2, 6, 10, 14); _quarter(s, 3, 7, 11, 15)
            _quarter(s, 0, 5, 10, 15); _quarter(s, 1, 6, 11, 12)
            _quarter(s, 2, 7, 8, 13); _quarter(s, 3, 4, 9, 14)
        out += struct.pack("<16I", *((x + y) & 0xFFFFFFFF for x, y in zip(s, state)))
        counter += 1
    return bytes(out[:size])


def mask_words(seed: bytes, count: int, bits: int) -> list[int]:
    width = 4 if bits <= 32 else 8
    stream = chacha20_keystream(seed, count * width)
    return [int.from_bytes(stream[i:i + width], "little") % (1 << bits)
            for i in range(0, len(stream), width)]


def split(secret: bytes, threshold: int, xs: Sequence[int], coefficients: Sequence[int]
          ) -> list[bytes]:
    poly = [int.from_bytes(secret, "big"), *coefficients]
    assert len(poly) == threshold
    return [x.to_bytes(4, "big") + (sum(c * pow(x, j, P) for j, c in enumerate(poly)) % P)
            .to_bytes(66, "big") for x in xs]


def coefficient(draw: Draw, kind: bytes, client: int, j: int) -> int:
    return int.from_bytes(draw(b"coefficient " + kind + b" " + i64(client)
                               + j.to_bytes(4, "big"), 64), "big") % P


class SecondClient:
    """One client of one round; ``params`` holds degree, threshold, modulus_bits."""

    def __init__(self, client: int, round_seed: bytes, params: Mapping[str, int],
                 draw: Draw = live_draw) -> None:
        self.client, self.round_seed, self.params, self.draw = client, round_seed, params, draw
        self.share_private = draw(b"share key " + i64(client), 32)
        self.mask_private = draw(b"mask key " + i64(client), 32)
        self.seed = draw(b"self-mask seed " + i64(client), 32)
        self.mask_keys: dict[int, bytes] = {}
        self.held: dict[int, tuple[bytes, bytes]] = {}
        self.own: tuple[bytes, bytes] = (b"", b"")
        self.sharers: list[int] = []

    def advert(self) -> bytes:
        return (x25519_public(self.share_private) + x25519_public(self.mask_private)
                + commitment(self.seed, self.round_seed, self.client))

    def share(self, members: Sequence[int], adverts: Mapping[int, bytes]) -> list[tuple[int, bytes]]:
        mine = graph(self.round_seed, members, self.params["degree"])[self.client]
        t = self.params["threshold"]
        xs = [v + 1 for v in mine] + [self.client + 1]
        shares = []
        for kind, secret in ((b"seed", self.seed), (b"key", self.mask_private)):
            coefficients = [coefficient(self.draw, kind, self.client, j) for j in range(1, t)]
            shares.append(split(secret, t, xs, coefficients))
        seed_shares, key_shares = shares
        self.own = (seed_shares[-1], key_shares[-1])
        rows = []
        for v, s, k in zip(mine, seed_shares, key_shares):
            self.mask_keys[v] = adverts[v][32:64]
            ephemeral = self.draw(b"ephemeral " + i64(self.client) + i64(v), 32)
            nonce = self.draw(b"nonce " + i64(self.client) + i64(v), 12)
            key = hkdf(x25519(ephemeral, adverts[v][:32]), self.round_seed, b"share sealing",
                       self.client, v)
            box = AESGCM(key).encrypt(nonce, s + k, aad(self.round_seed, self.client, v))
            rows.append((v, x25519_public(ephemeral) + nonce + box))
        return rows

    def open(self, delivered: Sequence[tuple[int, bytes]]) -> list[int]:
        accused = []
        for sender, row in sorted(delivered):
            self.sharers.append(sender)
            key = hkdf(x25519(self.share_private, row[:32]), self.round_seed, b"share sealing",
                       sender, self.client)
            try:
                plain = AESGCM(key).decrypt(row[32:44], row[44:],
                                            aad(self.round_seed, sender, self.client))
            except Exception:
                accused.append(sender)
                continue
            self.held[sender] = (plain[:SHARE_BYTES], plain[SHARE_BYTES:])
        return accused

    def pairwise_seed(self, other: int) -> bytes:
        return hkdf(x25519(self.mask_private, self.mask_keys[other]), self.round_seed,
                    b"pairwise mask", self.client, other)

    def mask(self, update: Sequence[int]) -> list[int]:
        bits = self.params["modulus_bits"]
        vector = [*update, 1, 1]  # the two count-check elements
        total = [a + b for a, b in zip(vector, mask_words(self.seed, len(vector), bits))]
        for other in sorted(self.sharers):
            sign = 1 if self.client < other else -1
            words = mask_words(self.pairwise_seed(other), len(vector), bits)
            total = [a + sign * b for a, b in zip(total, words)]
        return [a % (1 << bits) for a in total]

    def unmask(self, survivors: Sequence[int], dropped: Sequence[int]) -> list[tuple[int, int, bytes]]:
        held = {**self.held, self.client: self.own}
        rows = [(o, 0, held[o][0]) for o in sorted(held) if o in survivors]
        rows += [(o, 1, self.held[o][1]) for o in sorted(self.held) if o in dropped]
        return rows
