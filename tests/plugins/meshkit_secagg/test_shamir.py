"""Shamir t-of-n over GF(2**521 - 1): any t shares rebuild a secret, fewer reveal nothing useful."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshkit_secagg import PRIME, SHARE_SIZE, Share, shamir_combine, shamir_split


@settings(max_examples=40, deadline=None, derandomize=True)
@given(secret=st.binary(min_size=32, max_size=32), threshold=st.integers(1, 6),
       extra=st.integers(0, 5), data=st.data())
def test_any_threshold_shares_rebuild_the_secret(secret: bytes, threshold: int, extra: int,
                                                data: st.DataObject) -> None:
    xs = data.draw(st.lists(st.integers(1, 2 ** 32 - 1), min_size=threshold + extra,
                            max_size=threshold + extra, unique=True))
    shares = shamir_split(secret, threshold, xs)
    chosen = data.draw(st.permutations(shares))[:threshold]
    assert shamir_combine(chosen, threshold) == secret


def test_fewer_than_threshold_shares_are_refused_and_interpolate_to_something_else() -> None:
    secret = b"\x42" * 32
    shares = shamir_split(secret, 3, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="2 shares; 3 are needed"):
        shamir_combine(shares[:2], 3)
    # Interpolating two points of a degree-2 polynomial is not the secret.
    for pair in itertools.combinations(shares, 2):
        try:
            assert shamir_combine(pair, 2) != secret
        except ValueError:
            pass  # not even a 32-byte value


def test_a_tampered_share_does_not_rebuild_the_secret() -> None:
    secret = bytes(range(32))
    shares = shamir_split(secret, 3, [5, 6, 7])
    bad = Share(shares[0].x, (shares[0].y + 1) % PRIME)
    try:
        assert shamir_combine([bad, *shares[1:]], 3) != secret
    except ValueError as error:
        assert "32-byte secret" in str(error)


def test_a_share_travels_in_its_fixed_size_and_malformed_ones_are_refused() -> None:
    share = shamir_split(bytes(32), 2, [1, 9])[1]
    data = share.to_bytes()
    assert len(data) == SHARE_SIZE and Share.from_bytes(data) == share
    with pytest.raises(ValueError, match="70 bytes"):
        Share.from_bytes(data[:-1])
    with pytest.raises(ValueError, match="x must be"):
        Share.from_bytes(bytes(4) + data[4:])
    with pytest.raises(ValueError, match="below the field's prime"):
        Share.from_bytes(data[:4] + PRIME.to_bytes(66, "big"))


def test_two_shares_at_one_point_are_refused() -> None:
    shares = shamir_split(bytes(32), 2, [1, 2])
    with pytest.raises(ValueError, match="same point"):
        shamir_combine([shares[0], shares[0]], 2)
    with pytest.raises(ValueError, match="distinct"):
        shamir_split(bytes(32), 2, [3, 3])
