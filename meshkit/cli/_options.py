"""Command-line strings into values a node can use: ``KEY=VALUE`` tables and the secret.

Every value is typed by the component's options class before anything
connects, and every failure names the flag or table and the key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from meshkit import wire
from meshkit.errors import ConfigError
from meshkit.options import parse_options

# parse_options lives in meshkit.options (the train layer types --task-option with it).
__all__ = ["read_secret", "parse_options", "parse_board_options"]


def read_secret(secret_file: str | None, environ: Mapping[str, str] | None = None) -> bytes:
    """The shared secret from ``secret_file`` or ``MESHKIT_SECRET``; refuse without one."""
    env = os.environ if environ is None else environ
    if secret_file:
        # The same rule as [mesh] secret_file (meshkit.wire, docs/security.md).
        return wire.read_secret_file(Path(secret_file).expanduser(), "--secret-file")
    secret_env = (env.get("MESHKIT_SECRET") or "").strip()
    if secret_env:
        return wire.secret_from_text(secret_env)
    raise ConfigError(
        "no shared secret: a node refuses to join a mesh unauthenticated. Pass "
        "--secret-file FILE (the same secret as the coordinator's secret_file) or set "
        "MESHKIT_SECRET")


def parse_board_options(pairs: Sequence[str], options_cls: type | None) -> dict[str, Any]:
    """``--board-option KEY=VALUE`` strings as a board options table (see :func:`parse_options`)."""
    return parse_options(pairs, options_cls, flag="--board-option", table="[board]")
