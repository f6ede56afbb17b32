"""Command-line strings into values a node can use: ``KEY=VALUE`` tables and the secret.

Every value is typed by the component's options class before anything
connects, and every failure names the flag or table and the key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import attrs

from meshkit import wire
from meshkit.errors import ConfigError

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


def _field_kind(field: Any) -> str:
    """The plain type name of an attrs field ('int', 'float', 'bool', 'str'), best effort."""
    annotation = field.type
    if isinstance(annotation, type):
        return annotation.__name__
    text = str(annotation or "")
    for name in ("bool", "int", "float", "str"):
        if text == name or text.startswith(name + " ") or text.startswith(name + "|"):
            return name
    return "str"


def parse_board_options(pairs: Sequence[str], options_cls: type | None) -> dict[str, Any]:
    """``--board-option KEY=VALUE`` strings as a board options table (see :func:`parse_options`)."""
    return parse_options(pairs, options_cls, flag="--board-option", table="[board]")


def parse_options(pairs: Sequence[str], options_cls: type | None, *, flag: str,
                  table: str) -> dict[str, Any]:
    """Turn ``KEY=VALUE`` strings into a component options table, typed by ``options_cls``.

    Values are converted to each field's declared type (int, float, bool),
    so ``--board-option input_elems=8`` is the integer 8; a value that does
    not convert is a :class:`ConfigError` naming the key. Unknown keys are
    passed through for the options class to refuse with its own message.
    """
    fields = {f.name: f for f in attrs.fields(options_cls)} if options_cls is not None else {}
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"{flag} {pair!r}: expected KEY=VALUE")
        if key in options:
            raise ConfigError(f"{flag} {key}: given twice")
        field = fields.get(key)
        kind = _field_kind(field) if field is not None else "str"
        value: Any = raw
        try:
            if kind == "int":
                value = int(raw)
            elif kind == "float":
                value = float(raw)
            elif kind == "bool":
                lowered = raw.strip().lower()
                if lowered not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                    raise ValueError(raw)
                value = lowered in ("1", "true", "yes", "on")
        except ValueError:
            raise ConfigError(
                f"{table} {key}: expected {'an integer' if kind == 'int' else 'a number' if kind == 'float' else 'true or false'}, "
                f"got {raw!r}") from None
        options[key] = value
    return options
