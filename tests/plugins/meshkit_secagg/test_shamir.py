"""Shamir t-of-n over GF(2**521 - 1): any t shares rebuild a secret, fewer reveal nothing useful."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshkit_secagg import PRIME, SHARE_SIZE, Share, shamir_combine, shamir_split
from meshkit_secagg._shamir import _lagrange_at_zero, inverses


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


@settings(max_examples=40, deadline=None, derandomize=True)
@given(values=st.lists(st.integers(1, PRIME - 1), min_size=1, max_size=12))
def test_the_batch_inverses_are_each_values_own_inverse(values: list[int]) -> None:
    assert inverses(values) == [pow(v, -1, PRIME) for v in values]


def test_zero_has_no_inverse_in_a_batch() -> None:
    with pytest.raises(ValueError, match="no inverse"):
        inverses([3, PRIME, 5])


def test_the_lagrange_coefficients_are_the_textbook_ones() -> None:
    # Fermat's inversion, one denominator at a time: the definition the batch must equal.
    xs = (1, 4, 9, 2 ** 32 - 1, 77)
    expected = []
    for i, xi in enumerate(xs):
        numerator = denominator = 1
        for j, xj in enumerate(xs):
            if i != j:
                numerator, denominator = numerator * xj % PRIME, denominator * (xj - xi) % PRIME
        expected.append(numerator * pow(denominator, PRIME - 2, PRIME) % PRIME)
    assert _lagrange_at_zero(xs) == tuple(expected)
    # A share at a large point after many Horner steps (the split reduces in batches).
    secret = bytes(range(32))
    shares = shamir_split(secret, 20, [2 ** 32 - 1 - i for i in range(20)])
    assert shamir_combine(shares, 20) == secret
