"""Key agreement and sealing: both ends derive one key per purpose, pair and round; seals bind their ends."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshkit_secagg._agreement import (PAIRWISE, SEALED_OVERHEAD, SEALED_TO_OVERHEAD, SEALING,
                                       agree, check_public_key, derive, generate_key_pair,
                                       generate_private, open_from, open_revealed, open_sealed,
                                       private_key, public_key, seal, seal_to, seed_commitment)


def test_both_ends_derive_the_same_key_and_nothing_else_does() -> None:
    (a_priv, a_pub), (b_priv, b_pub) = generate_key_pair(), generate_key_pair()
    ab = derive(agree(a_priv, b_pub), b"round", PAIRWISE, 3, 8)
    assert ab == derive(agree(b_priv, a_pub), b"round", PAIRWISE, 8, 3)
    assert len(ab) == 32
    assert ab != derive(agree(a_priv, b_pub), b"round", SEALING, 3, 8)       # purpose
    assert ab != derive(agree(a_priv, b_pub), b"another", PAIRWISE, 3, 8)    # round
    assert ab != derive(agree(a_priv, b_pub), b"round", PAIRWISE, 3, 9)      # pair


def test_a_seal_opens_only_for_its_round_sender_and_recipient() -> None:
    key = bytes(range(32))
    sealed = seal(key, b"shares", b"round", 1, 2)
    assert len(sealed) == len(b"shares") + SEALED_OVERHEAD
    assert open_sealed(key, sealed, b"round", 1, 2) == b"shares"
    for args in [(b"round", 2, 1), (b"round", 1, 3), (b"other", 1, 2)]:
        with pytest.raises(ValueError, match="do not authenticate"):
            open_sealed(key, sealed, *args)
    with pytest.raises(ValueError, match="shorter"):
        open_sealed(key, sealed[:20], b"round", 1, 2)


def test_a_small_order_or_short_public_key_is_refused() -> None:
    private, public = generate_key_pair()
    check_public_key(public)
    assert public_key(private) == public
    for bad in (bytes(32), b"\x01" + bytes(31), bytes(31)):
        with pytest.raises(ValueError):
            check_public_key(bad)


def test_the_seed_commitment_binds_the_round_and_the_client() -> None:
    seed = bytes(32)
    c = seed_commitment(seed, b"round", 4)
    assert c != seed_commitment(seed, b"round", 5)
    assert c != seed_commitment(seed, b"round 2", 4)
    assert c != seed_commitment(b"\x01" * 32, b"round", 4)


def test_a_share_sealed_to_a_key_opens_for_its_recipient_and_with_the_revealed_ephemeral_key():
    recipient_private, recipient_public = generate_key_pair()
    ephemeral, sealed = seal_to(recipient_public, b"shares", b"round", 1, 2)
    assert len(sealed) == len(b"shares") + SEALED_TO_OVERHEAD
    assert open_from(recipient_private, sealed, b"round", 1, 2) == b"shares"
    # The coordinator opens it with the sealer's revealed ephemeral key and the public key.
    assert open_revealed(ephemeral, recipient_public, sealed, b"round", 1, 2) == b"shares"
    other, _ = generate_key_pair()
    with pytest.raises(ValueError, match="not the one the share was sealed with"):
        open_revealed(other, recipient_public, sealed, b"round", 1, 2)
    garbage = sealed[:32] + bytes(len(sealed) - 32)
    with pytest.raises(ValueError, match="do not authenticate"):
        open_revealed(ephemeral, recipient_public, garbage, b"round", 1, 2)
    with pytest.raises(ValueError, match="do not authenticate"):
        open_from(recipient_private, sealed, b"round", 1, 3)  # another recipient's binding
    # A second sealing to the same key uses another ephemeral key.
    assert seal_to(recipient_public, b"shares", b"round", 1, 2)[1][:32] != sealed[:32]


def test_a_loaded_key_agrees_as_its_raw_bytes_do_and_refuses_the_same_keys() -> None:
    (a_priv, a_pub), (_, b_pub) = generate_key_pair(), generate_key_pair()
    loaded = private_key(a_priv)
    assert agree(loaded, b_pub) == agree(a_priv, b_pub)
    fresh = generate_private()
    assert public_key(fresh.private_bytes_raw()) == fresh.public_key().public_bytes_raw()
    for bad in (bytes(32), b"\x01" + bytes(31), bytes(31)):
        with pytest.raises(ValueError):
            agree(loaded, bad)


def test_sealing_to_a_small_order_or_short_key_is_refused() -> None:
    # The sealing agreement is the share key's only check on a client: it must refuse.
    for bad in (bytes(32), b"\x01" + bytes(31), bytes(31)):
        with pytest.raises(ValueError):
            seal_to(bad, b"shares", b"round", 1, 2)


@settings(max_examples=50, deadline=None, derandomize=True)
@given(shared=st.binary(min_size=32, max_size=32), seed=st.binary(max_size=70),
       a=st.integers(0, 2 ** 32), b=st.integers(0, 2 ** 32))
def test_derive_is_rfc5869_hkdf_sha256_to_the_byte(shared: bytes, seed: bytes, a: int,
                                                   b: int) -> None:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    lo, hi = sorted((a, b))
    info = (b"meshkit/secagg/1 " + PAIRWISE + b" " + lo.to_bytes(8, "big", signed=True)
            + hi.to_bytes(8, "big", signed=True))
    expected = HKDF(algorithm=hashes.SHA256(), length=32, salt=seed, info=info).derive(shared)
    assert derive(shared, seed, PAIRWISE, a, b) == expected
