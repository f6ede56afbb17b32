"""Turning config tables into attrs options classes with cattrs, strictly.

Every error names the table and the key, so ``meshkit check`` can say
``config.toml: [aggregator] trim: expected float, got 'a lot'``, and an unknown
key says which known key it is closest to (``[strategy] runds: unknown key
(did you mean 'rounds'?)``).
"""

from __future__ import annotations

import collections.abc
import difflib
import re
import types
import typing
from typing import Any, Iterable, Mapping, Sequence

import attrs
import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError

from meshkit.errors import ConfigError

__all__ = ["converter", "closest", "structure_strict", "structure_options", "positive",
           "non_negative", "parse_options"]

def positive(instance: Any, attribute: Any, value: Any) -> None:
    """attrs validator: the option must be greater than zero."""
    if value <= 0:
        raise ValueError(f"{attribute.name} must be positive, got {value}")


def non_negative(instance: Any, attribute: Any, value: Any) -> None:
    """attrs validator: the option must be zero or more."""
    if value < 0:
        raise ValueError(f"{attribute.name} must be zero or more, got {value}")


#: The converter for user-facing config: unknown keys are errors.
converter = cattrs.Converter(forbid_extra_keys=True)


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The one of ``choices`` a misspelt ``word`` most likely meant, or None if none is close."""
    choices = [str(c) for c in choices]
    by_lower = {c.lower(): c for c in choices}
    # Case is the commonest slip ("Rounds"); difflib alone would rank it low.
    if word.lower() in by_lower:
        return by_lower[word.lower()]
    matches = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return matches[0] if matches else None


def _unknown_key(cls: Any, key: str) -> str:
    fields = [f.name for f in attrs.fields(cls)] if attrs.has(cls) else []
    near = closest(key, fields)
    if near:
        return f"unknown key (did you mean {near!r}?)"
    return f"unknown key; the keys are {', '.join(fields)}" if fields else "unknown key"


def _describe(exc: BaseException, where: str) -> list[str]:
    """Flatten a cattrs error tree into ``[table] key: problem`` lines."""
    lines: list[str] = []

    def walk(err: BaseException, path: str) -> None:
        if isinstance(err, ForbiddenExtraKeysError):
            for key in sorted(err.extra_fields):
                problem = _unknown_key(err.cl, key)
                lines.append(f"{where} {path}.{key}: {problem}"
                             if path else f"{where} {key}: {problem}")
            return
        if isinstance(err, (ClassValidationError, IterableValidationError)):
            for sub in err.exceptions:
                note = _note_for(sub)
                joiner = "" if note.startswith("[") else "."  # boards[0], not boards.[0]
                walk(sub, f"{path}{joiner}{note}" if path and note else (note or path))
            return
        label = f"{where} {path}" if path else where
        lines.append(f"{label}: {_problem(err)}")

    walk(exc, "")
    return lines or [f"{where}: {exc}"]


def _note_for(exc: BaseException) -> str:
    for note in getattr(exc, "__notes__", []) or []:
        name = getattr(note, "name", None)
        if name is not None:
            return str(name)
        m = re.match(r"Structuring class \S+ @ attribute (\w+)", str(note))
        if m:
            return m.group(1)
        index = getattr(note, "index", None)
        if index is not None:
            return f"[{index}]"
    return ""


def _problem(exc: BaseException) -> str:
    if isinstance(exc, KeyError):
        return "required key is missing"
    if isinstance(exc, (TypeError, ValueError)) and "required positional argument" in str(exc):
        return "required key is missing"
    text = str(exc)
    if isinstance(exc, (ValueError, TypeError)) and text:
        return f"invalid value: {text}"
    return text or type(exc).__name__


_PRIMITIVES = {"int": int, "float": float, "str": str, "bool": bool}


def _field_types(cls: type) -> dict[str, Any]:
    """Field name -> type, resolved from string annotations when possible."""
    try:
        attrs.resolve_types(cls)
    except Exception:  # an unresolvable forward reference: check what we can
        pass
    return {f.name: f.type for f in attrs.fields(cls)}


def _check_types(cls: type, data: Mapping[str, Any], where: str, prefix: str = "") -> None:
    """Reject values cattrs would silently coerce (``"5"`` for an int, 1 for a str).

    Nested tables (``[[strategy.partitions]]``) are checked too: cattrs would
    otherwise turn ``rank = 1.9`` into rank 1 and ``nodes = "abc"`` into
    ``["a", "b", "c"]``.
    """
    types = _field_types(cls)
    for key, value in data.items():
        if key in types:
            _check_value(types[key], value, where, f"{prefix}{key}")


def _check_value(expected: Any, value: Any, where: str, label: str) -> None:
    if isinstance(expected, str):
        expected = _PRIMITIVES.get(expected)
    origin = typing.get_origin(expected)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(expected) if a is not type(None)]
        if value is None and len(options) < len(typing.get_args(expected)):
            return
        if len(options) == 1:
            _check_value(options[0], value, where, label)
        return
    if origin in (list, tuple, collections.abc.Sequence):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} {label}: expected an array, got {value!r}")
        args = typing.get_args(expected)
        if args and (origin is not tuple or (len(args) == 2 and args[1] is Ellipsis)):
            for i, item in enumerate(value):
                _check_value(args[0], item, where, f"{label}[{i}]")
        return
    if origin in (dict, collections.abc.Mapping) or expected in (dict, collections.abc.Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} {label}: expected a table, got {value!r}")
        return
    if isinstance(expected, type) and attrs.has(expected):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} {label}: expected a table, got {value!r}")
        _check_types(expected, value, where, f"{label}.")
        return
    if expected is bool and not isinstance(value, bool):
        raise ConfigError(f"{where} {label}: expected true or false, got {value!r}")
    if expected is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{where} {label}: expected an integer, got {value!r}")
    if expected is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigError(f"{where} {label}: expected a number, got {value!r}")
    if expected is str and not isinstance(value, str):
        raise ConfigError(f"{where} {label}: expected a string, got {value!r}")


def structure_strict(data: Mapping[str, Any], cls: type, *, where: str) -> Any:
    """Structure ``data`` into attrs class ``cls``; a :class:`ConfigError` on any problem."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a table, got {data!r}")
    _check_types(cls, data, where)
    try:
        return converter.structure(dict(data), cls)
    except (ClassValidationError, ForbiddenExtraKeysError, IterableValidationError) as exc:
        raise ConfigError("; ".join(_describe(exc, where))) from None
    except (TypeError, ValueError, KeyError) as exc:
        # attrs validators raise these from __init__.
        raise ConfigError(f"{where}: {_problem(exc)}") from None


def structure_options(component: Any, data: Mapping[str, Any], *, where: str) -> Any:
    """Structure a component's options table (no keys allowed when it has none)."""
    if component.options is None:
        if data:
            keys = ", ".join(sorted(data))
            raise ConfigError(
                f"{where} {keys}: unknown key; {component.name!r} takes no options")
        return None
    return structure_strict(data, component.options, where=where)


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
