"""The shared secret's check and the key schedule (``meshkit.wire._keys``)."""

from __future__ import annotations

import hmac as std_hmac

import pytest

from meshkit import wire
from meshkit.errors import ConfigError
from meshkit.wire._keys import _derive_keys, _hmac_sha256

from tests.support.channels import SECRET, tcp_pair
MINE = bytes(range(48)) + b"a" * 32
THEIRS = bytes(range(48)) + b"b" * 32


def test_no_secret_is_refused_before_connecting():
    a, b = tcp_pair()
    with pytest.raises(ConfigError, match="no shared secret"):
        wire.handshake(a, None, rank=0, world=2)
    with pytest.raises(ConfigError, match="no shared secret"):
        wire.handshake(a, b"", rank=0, world=2)
    with pytest.raises(ConfigError, match=r"must be bytes, got a str; pass secret.encode\(\)"):
        wire.handshake(a, "text", rank=0, world=2)  # type: ignore[arg-type]
    a.close(), b.close()


def test_both_ends_derive_the_same_keys_mirrored_and_each_direction_its_own():
    here = _derive_keys(SECRET, MINE, THEIRS)
    there = _derive_keys(SECRET, THEIRS, MINE)
    assert (here.send_header, here.send_body) == (there.recv_header, there.recv_body)
    assert (here.recv_header, here.recv_body) == (there.send_header, there.send_body)
    assert (here.confirm_mine, here.confirm_theirs) == (there.confirm_theirs, there.confirm_mine)
    # Bound to the sender's nonce: a frame echoed back to its sender never verifies.
    assert here.send_header != here.recv_header and here.send_body != here.recv_body
    assert len({here.send_header, here.send_body, here.confirm_mine}) == 3


def test_every_key_depends_on_the_secret_and_on_every_byte_of_both_hellos():
    base = _derive_keys(SECRET, MINE, THEIRS)
    changed_field = bytearray(THEIRS)
    changed_field[20] ^= 1  # e.g. a rank or world the peer announced
    for other in (_derive_keys(SECRET + b"!", MINE, THEIRS),
                  _derive_keys(SECRET, MINE, bytes(changed_field))):
        assert other.send_header != base.send_header
        assert other.send_body != base.send_body
        assert other.confirm_mine != base.confirm_mine


@pytest.mark.parametrize("key_len", [16, 32, 64, 65, 100])
def test_the_prepared_header_mac_is_hmac_sha256(key_len):
    key = bytes(range(key_len))
    mac = _hmac_sha256(key)
    for data in (b"", b"x" * 40, bytes(200)):
        assert mac(data) == std_hmac.digest(key, data, "sha256")
        assert mac(data) == mac(data)  # the prepared states are copied, never consumed
