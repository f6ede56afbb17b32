"""Shamir t-of-n secret sharing of 32-byte secrets over the prime field GF(2**521 - 1).

A secret (a self-mask seed or an X25519 private key: 32 bytes, an integer
below ``2**256``) is the constant term of a random polynomial of degree
``t - 1`` over GF(p), ``p = 2**521 - 1`` (the Mersenne prime M521: larger
than every secret, so no secret is reduced, and its size is no secret's
business); a share is the polynomial's value at ``x = holder id + 1``
(never 0, which is the secret). Any ``t`` shares give the secret back by
Lagrange interpolation at 0; fewer than ``t`` are uniformly distributed
whatever the secret (Shamir, "How to share a secret", CACM 1979).

The polynomial's coefficients come from :func:`secrets.randbelow` (the
OS's CSPRNG). A share travels as ``X_SIZE + VALUE_SIZE`` bytes (``x``
big-endian uint32, the value big-endian, 66 bytes); a value not below ``p``
or an ``x`` of 0 is malformed.
"""

from __future__ import annotations

import functools
import secrets as _secrets
from typing import Iterable, Sequence

import attrs

__all__ = ["PRIME", "Share", "shamir_split", "shamir_combine", "SECRET_SIZE", "SHARE_SIZE"]

#: The field's prime: the Mersenne prime 2**521 - 1.
PRIME = (1 << 521) - 1
#: Bytes of a secret.
SECRET_SIZE = 32
#: Bytes of a share's value (big-endian, < PRIME).
VALUE_SIZE = 66
#: Bytes of a share's x coordinate (big-endian uint32).
X_SIZE = 4
#: Bytes of one serialised share.
SHARE_SIZE = X_SIZE + VALUE_SIZE


@attrs.frozen
class Share:
    """One point ``(x, y)`` of a sharing polynomial; ``x >= 1``, ``0 <= y < PRIME``."""

    x: int
    y: int

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.x < (1 << 32):
            raise ValueError(f"a share's x must be 1 to 2**32 - 1, got {self.x}")
        if not 0 <= self.y < PRIME:
            raise ValueError("a share's value must be below the field's prime 2**521 - 1")

    def to_bytes(self) -> bytes:
        return self.x.to_bytes(X_SIZE, "big") + self.y.to_bytes(VALUE_SIZE, "big")

    @classmethod
    def from_bytes(cls, data: bytes) -> "Share":
        """The share ``data`` holds; ``ValueError`` for a wrong length or an out-of-range value."""
        if len(data) != SHARE_SIZE:
            raise ValueError(f"a share is {SHARE_SIZE} bytes, got {len(data)}")
        return cls(int.from_bytes(data[:X_SIZE], "big"), int.from_bytes(data[X_SIZE:], "big"))


def shamir_split(secret: bytes, threshold: int, xs: Sequence[int]) -> list[Share]:
    """Shares of ``secret`` (32 bytes) at the points ``xs`` (distinct, >= 1); any ``threshold`` rebuild it."""
    if len(secret) != SECRET_SIZE:
        raise ValueError(f"a secret is {SECRET_SIZE} bytes, got {len(secret)}")
    if len(set(xs)) != len(xs):
        raise ValueError("share points must be distinct")
    if not 1 <= threshold <= len(xs):
        raise ValueError(f"threshold must be 1 to the {len(xs)} shares, got {threshold}")
    coefficients = [int.from_bytes(secret, "big")]
    coefficients += [_secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    shares = []
    for x in xs:
        y = 0
        for i, c in enumerate(reversed(coefficients)):  # Horner
            y = y * x + c
            # x is below 2**32: reducing every _REDUCE_EVERY steps keeps y under about
            # 521 + 33 * _REDUCE_EVERY bits and skips most 521-bit reductions (same value mod p).
            if i % _REDUCE_EVERY == _REDUCE_EVERY - 1:
                y %= PRIME
        shares.append(Share(x, y % PRIME))
    return shares


#: Horner steps between reductions in :func:`shamir_split`.
_REDUCE_EVERY = 8


@functools.lru_cache(maxsize=64)
def _lagrange_at_zero(xs: tuple[int, ...]) -> tuple[int, ...]:
    # The coefficients depend on the points only; a round rebuilds many
    # secrets from the same responders (all of them, on the complete graph).
    numerators, denominators = [], []
    for i, xi in enumerate(xs):
        numerator, denominator = 1, 1
        for j, xj in enumerate(xs):
            if i != j:
                numerator = numerator * xj % PRIME
                denominator = denominator * (xj - xi) % PRIME
        numerators.append(numerator)
        denominators.append(denominator)
    return tuple(n * d % PRIME for n, d in zip(numerators, inverses(denominators)))


def inverses(values: Sequence[int]) -> list[int]:
    """Each value's inverse mod :data:`PRIME`, from one modular inversion (Montgomery's trick).

    The values are non-zero mod PRIME (here: products of differences of
    distinct points below 2**32). One inversion of a 521-bit number costs
    as much as hundreds of multiplications, so the prefix products are
    inverted once and unwound. ``ValueError`` for a value that is 0 mod PRIME.
    """
    prefix, running = [], 1
    for v in values:
        prefix.append(running)
        running = running * v % PRIME
    if running == 0:
        raise ValueError("0 has no inverse mod PRIME")
    inverse = pow(running, -1, PRIME)
    out = [0] * len(values)
    for i in range(len(values) - 1, -1, -1):
        out[i] = inverse * prefix[i] % PRIME
        inverse = inverse * values[i] % PRIME
    return out


def shamir_combine(shares: Iterable[Share], threshold: int) -> bytes:
    """The secret of ``threshold`` of ``shares`` (the first ones, by x), 32 bytes.

    Raises ``ValueError`` with fewer than ``threshold`` shares, two shares at
    one point, or points whose interpolation is not a 32-byte secret (shares
    of different secrets, or a tampered one). Shares of a wrong secret that
    happen to interpolate below ``2**256`` cannot be told apart here: the
    caller checks the secret against what it commits to.
    """
    chosen = sorted(shares, key=lambda s: s.x)
    if len({s.x for s in chosen}) != len(chosen):
        raise ValueError("two shares at the same point")
    if len(chosen) < threshold:
        raise ValueError(f"{len(chosen)} shares; {threshold} are needed")
    chosen = chosen[:threshold]
    coefficients = _lagrange_at_zero(tuple(s.x for s in chosen))
    secret = sum(c * s.y for c, s in zip(coefficients, chosen)) % PRIME
    if secret >> (8 * SECRET_SIZE):
        raise ValueError("the shares do not interpolate to a 32-byte secret")
    return secret.to_bytes(SECRET_SIZE, "big")
