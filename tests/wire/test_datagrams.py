"""Single authenticated datagrams (``meshkit.wire._datagrams``)."""

from __future__ import annotations

import pytest

from meshkit import wire
from meshkit.errors import AuthenticationError, WireError

from tests.support.channels import SECRET
def test_datagrams_are_authenticated_under_the_shared_secret():
    sealed = wire.seal_datagram(SECRET, b"rank=3 port=29503")
    assert wire.open_datagram(SECRET, sealed) == b"rank=3 port=29503"
    with pytest.raises(AuthenticationError, match="wrong secret"):
        wire.open_datagram(b"another secret 0123", sealed)
    tampered = bytearray(sealed)
    tampered[6] ^= 1
    with pytest.raises(AuthenticationError):
        wire.open_datagram(SECRET, bytes(tampered))
    with pytest.raises(WireError, match="not a meshkit datagram"):
        wire.open_datagram(SECRET, b"hello")
