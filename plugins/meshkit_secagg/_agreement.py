"""Key agreement and share encryption: X25519, HKDF-SHA256, AES-256-GCM.

Each client makes two fresh X25519 key pairs per round (Bonawitz et al.
2017): the *share* pair, to which its neighbours seal the shares they send
it (so the coordinator that routes them reads nothing), and the *mask*
pair, whose agreement with a neighbour is the pairwise mask seed.

Shares are sealed to the recipient's share key with a fresh *ephemeral*
X25519 key per sealed share (:func:`seal_to`, ECIES-style; the ephemeral
public key travels in front of the ciphertext). That is what makes a share
that does not open provable: the sealer can be asked for that one
ephemeral private key (:func:`open_revealed`), which the coordinator checks
against the ephemeral public key it routed and uses to open the share
itself. Revealing it exposes that one share and nothing else the sealer
holds; a static agreement key would expose every share sealed under it. Every derived key is HKDF-SHA256 (RFC
5869) of the raw X25519 value, salted with the round's public seed and
labelled with its purpose and both ids (smaller first), so no key serves
two purposes, two pairs or two rounds. The self-mask seed is 32 bytes from
the OS's CSPRNG; the advert carries a SHA-256 commitment to it, against
which the coordinator checks the seed it reconstructs.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

__all__ = ["KEY_SIZE", "generate_key_pair", "generate_private", "private_key", "public_key", "agree", "check_public_key", "derive",
           "seed_commitment", "seal", "PAIRWISE", "SEALING", "open_sealed", "SEALED_OVERHEAD",
           "seal_to", "open_from", "open_revealed", "SEALED_TO_OVERHEAD"]

#: Bytes of an X25519 public or private key, and of every derived key.
KEY_SIZE = 32
#: What AES-GCM adds to a plaintext: a 12-byte random nonce in front, a 16-byte tag behind.
SEALED_OVERHEAD = 12 + 16
_LABEL = b"meshkit/secagg/1 "
#: HKDF purposes: a pair's mask seed, and the key a pair's shares are sealed under.
PAIRWISE = b"pairwise mask"
SEALING = b"share sealing"


def generate_key_pair() -> tuple[bytes, bytes]:
    """A fresh X25519 ``(private, public)`` pair, raw 32 bytes each."""
    private = X25519PrivateKey.generate()
    return private.private_bytes_raw(), private.public_key().public_bytes_raw()


def generate_private() -> X25519PrivateKey:
    """A fresh X25519 private key, as the object :func:`agree` takes without re-loading it."""
    return X25519PrivateKey.generate()


def private_key(private: bytes) -> X25519PrivateKey:
    """A raw private key as the object :func:`agree` takes: load a key once, agree many times.

    Loading a raw key computes its public half, which costs about as much as
    an agreement, and a client agrees with every neighbour under one key.
    """
    return X25519PrivateKey.from_private_bytes(private)


def public_key(private: bytes) -> bytes:
    """The raw X25519 public key of a raw private key (how a reconstructed key is checked)."""
    return private_key(private).public_key().public_bytes_raw()


def agree(private: bytes | X25519PrivateKey, public: bytes) -> bytes:
    """The raw X25519 value of ``private`` (raw, or loaded by :func:`private_key`) and a peer's ``public``.

    ``ValueError`` for a public key of the wrong length or of small order
    (an all-zero agreement: a key chosen to force a known seed).
    """
    if len(public) != KEY_SIZE:
        raise ValueError(f"an X25519 public key is {KEY_SIZE} bytes, got {len(public)}")
    key = private if isinstance(private, X25519PrivateKey) else private_key(private)
    return key.exchange(X25519PublicKey.from_public_bytes(public))


# Any private key serves to test a public key: a small-order point agrees to
# zero with every (clamped) scalar.
_PROBE = X25519PrivateKey.generate()


def check_public_key(public: bytes) -> None:
    """``ValueError`` unless ``public`` is a 32-byte X25519 key that agrees to a non-zero value."""
    if len(public) != KEY_SIZE:
        raise ValueError(f"an X25519 public key is {KEY_SIZE} bytes, got {len(public)}")
    _PROBE.exchange(X25519PublicKey.from_public_bytes(public))


def derive(shared: bytes, round_seed: bytes, purpose: bytes, a: int, b: int) -> bytes:
    """HKDF-SHA256 of an agreement for ``purpose`` between clients ``a`` and ``b`` (order-free).

    RFC 5869 written out for one 32-byte block: ``PRK = HMAC(salt, IKM)``,
    ``OKM = HMAC(PRK, info || 0x01)``. The same bytes as ``cryptography``'s
    ``HKDF`` (a test compares them), without building its objects for each
    of the ~15,000 keys a round at n = 100 derives.
    """
    lo, hi = sorted((a, b))
    info = (_LABEL + purpose + b" " + lo.to_bytes(8, "big", signed=True)
            + hi.to_bytes(8, "big", signed=True))
    prk = hmac.digest(round_seed, shared, "sha256")
    return hmac.digest(prk, info + b"\x01", "sha256")


def seed_commitment(seed: bytes, round_seed: bytes, client: int) -> bytes:
    """SHA-256 commitment to a client's self-mask seed (hiding: the seed is 256 random bits)."""
    return hashlib.sha256(_LABEL + b"self-mask commitment " + round_seed
                          + client.to_bytes(8, "big", signed=True) + seed).digest()


def _associated(round_seed: bytes, sender: int, recipient: int) -> bytes:
    return (_LABEL + b"shares " + round_seed + sender.to_bytes(8, "big", signed=True)
            + recipient.to_bytes(8, "big", signed=True))


def seal(key: bytes, plaintext: bytes, round_seed: bytes, sender: int, recipient: int) -> bytes:
    """AES-256-GCM of ``plaintext`` under ``key``, bound to the round, sender and recipient."""
    nonce = os.urandom(12)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, _associated(round_seed, sender, recipient))


def open_sealed(key: bytes, sealed: bytes, round_seed: bytes, sender: int, recipient: int) -> bytes:
    """The plaintext of :func:`seal`; ``ValueError`` when it does not authenticate."""
    if len(sealed) < SEALED_OVERHEAD:
        raise ValueError("a sealed share is shorter than its nonce and tag")
    try:
        return AESGCM(key).decrypt(sealed[:12], sealed[12:],
                                   _associated(round_seed, sender, recipient))
    except InvalidTag:
        raise ValueError("the sealed shares do not authenticate (tampered, misrouted, or "
                         "sealed under another key)") from None


#: What :func:`seal_to` adds: the ephemeral public key, then :data:`SEALED_OVERHEAD`.
SEALED_TO_OVERHEAD = KEY_SIZE + SEALED_OVERHEAD


def seal_to(recipient_key: bytes, plaintext: bytes, round_seed: bytes, sender: int,
            recipient: int) -> tuple[bytes, bytes]:
    """``plaintext`` sealed to ``recipient_key`` under a fresh ephemeral key: (its private, sealed).

    The key is HKDF-SHA256 of X25519(ephemeral, recipient_key), bound like
    :func:`derive` to the round and both ids; ``sealed`` is the ephemeral
    public key followed by :func:`seal`'s output. Keep the ephemeral private
    key to answer an accusation (:func:`open_revealed`). ``ValueError`` for a
    recipient key of the wrong size or small order.
    """
    ephemeral = generate_private()  # agreed with as it is, not re-loaded from its bytes
    key = derive(agree(ephemeral, recipient_key), round_seed, SEALING, sender, recipient)
    return ephemeral.private_bytes_raw(), (ephemeral.public_key().public_bytes_raw()
                                           + seal(key, plaintext, round_seed, sender, recipient))


def open_from(recipient_private: bytes | X25519PrivateKey, sealed: bytes, round_seed: bytes,
              sender: int, recipient: int) -> bytes:
    """The recipient's side of :func:`seal_to`; ``ValueError`` when it does not open."""
    if len(sealed) < SEALED_TO_OVERHEAD:
        raise ValueError("a sealed share is shorter than its ephemeral key, nonce and tag")
    key = derive(agree(recipient_private, sealed[:KEY_SIZE]), round_seed, SEALING, sender,
                 recipient)
    return open_sealed(key, sealed[KEY_SIZE:], round_seed, sender, recipient)


def open_revealed(ephemeral_private: bytes, recipient_key: bytes, sealed: bytes,
                  round_seed: bytes, sender: int, recipient: int) -> bytes:
    """A third party's opening of :func:`seal_to` with the sealer's revealed ephemeral key.

    ``ValueError`` when the key is not the one whose public half is in front
    of ``sealed``, or when ``sealed`` does not open under it.
    """
    if len(sealed) < SEALED_TO_OVERHEAD or len(ephemeral_private) != KEY_SIZE:
        raise ValueError("a sealed share or ephemeral key of the wrong size")
    if public_key(ephemeral_private) != sealed[:KEY_SIZE]:
        raise ValueError("the revealed key is not the one the share was sealed with")
    key = derive(agree(ephemeral_private, recipient_key), round_seed, SEALING, sender, recipient)
    return open_sealed(key, sealed[KEY_SIZE:], round_seed, sender, recipient)
