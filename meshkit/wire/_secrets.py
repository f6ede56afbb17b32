"""How every secret source becomes bytes, and which files may hold a secret.

One rule for every source, so two ends configured differently still agree:

* a **file** (``[mesh] secret_file``, ``meshkit node --secret-file``): its raw
  bytes with ASCII whitespace stripped from both ends (so the newline that
  ``openssl rand -hex 32 > secret`` or an editor leaves is not part of the
  secret); never hex- or base64-decoded: the 64 hex characters *are* the
  secret. The file must not be readable, writable or executable by group or
  others (``chmod 600``).
* the **environment** (``MESHKIT_SECRET``): the value with whitespace stripped
  from both ends, encoded as UTF-8.
* the **API** (``NodeConfig(secret=...)``, :func:`~meshkit.wire.handshake`):
  the bytes exactly as given.

Whatever the source, the result must be at least
:data:`~meshkit.wire.MIN_SECRET` (16) bytes.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from meshkit.errors import ConfigError
from meshkit.wire._keys import MIN_SECRET, _check_secret


def check_private_file(path: str | os.PathLike[str], what: str) -> None:
    """Refuse a key or secret file that group or others may access.

    ``what`` names the setting in the error (e.g. ``"[mesh] secret_file"``).
    """
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {os.fspath(path)!r}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"{what}: {os.fspath(path)!r} is accessible by group or others (mode "
            f"{stat.S_IMODE(mode):03o}); a secret must be private: run "
            f"`chmod 600 {os.fspath(path)}`")


def _checked(secret: bytes, what: str) -> bytes:
    if len(secret) < MIN_SECRET:
        raise ConfigError(
            f"{what} holds {len(secret)} bytes; use at least {MIN_SECRET} random bytes (e.g. "
            f"`openssl rand -hex 32 > secret`: its 64 hex characters are the secret)")
    return _check_secret(secret)


def read_secret_file(path: str | os.PathLike[str], what: str = "secret file") -> bytes:
    """The shared secret in ``path``: raw bytes, whitespace stripped at both ends.

    Refused (:class:`ConfigError` naming ``what`` and the path) if the file
    cannot be read, is accessible by group or others, or holds fewer than
    :data:`MIN_SECRET` bytes once stripped.
    """
    name = f"{what} {os.fspath(path)!r}"
    try:
        data = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read it: {exc.strerror}") from None
    if not data:
        raise ConfigError(f"{name} is empty; put the shared secret in it")
    check_private_file(path, what)
    return _checked(data, name)


def secret_from_text(value: str, what: str = "MESHKIT_SECRET") -> bytes:
    """A secret given as text (an environment variable): stripped, UTF-8 encoded, checked."""
    return _checked(value.strip().encode(), what)
