"""Single authenticated datagrams (UDP discovery): ``magic | payload | HMAC-SHA256``.

The key is derived from the shared secret alone (a datagram has no handshake),
under its own HKDF labels, so it is never a connection's key.
"""

from __future__ import annotations

import hmac

from meshkit.errors import AuthenticationError, WireError
from meshkit.wire._codec import MAC_SIZE
from meshkit.wire._keys import _LABEL, _check_secret, _hkdf_expand, _hkdf_extract

_DATAGRAM_MAGIC = b"MKD\x01"
MAX_DATAGRAM = 65_507


def _datagram_key(secret: bytes) -> bytes:
    prk = _hkdf_extract(_LABEL + b"datagram salt", secret)
    return _hkdf_expand(prk, _LABEL + b"datagram")


def seal_datagram(secret: bytes | None, payload: bytes) -> bytes:
    """``magic | payload | HMAC-SHA256`` under a key derived from ``secret``.

    Replay protection (a nonce or timestamp inside ``payload``) is the
    caller's: a datagram has no connection to hang a sequence number on.
    """
    key = _datagram_key(_check_secret(secret))
    data = _DATAGRAM_MAGIC + bytes(payload)
    if len(data) + MAC_SIZE > MAX_DATAGRAM:
        raise WireError(f"datagram payload of {len(payload)} bytes is too large for UDP")
    return data + hmac.digest(key, data, "sha256")


def open_datagram(secret: bytes | None, datagram: bytes) -> bytes:
    """Return the payload of a sealed datagram or raise WireError/AuthenticationError."""
    key = _datagram_key(_check_secret(secret))
    datagram = bytes(datagram)
    if len(datagram) < len(_DATAGRAM_MAGIC) + MAC_SIZE or not datagram.startswith(_DATAGRAM_MAGIC):
        raise WireError("not a meshkit datagram")
    data, tag = datagram[:-MAC_SIZE], datagram[-MAC_SIZE:]
    if not hmac.compare_digest(hmac.digest(key, data, "sha256"), tag):
        raise AuthenticationError("datagram failed authentication (wrong secret or forged)")
    return data[len(_DATAGRAM_MAGIC):]
