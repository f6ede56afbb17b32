"""Turning config tables into attrs options classes with cattrs, strictly.

Every error names the table and the key, so ``meshkit check`` can say
``config.toml: [aggregator] trim: expected float, got 'a lot'``.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import attrs
import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError

from meshkit.errors import ConfigError

__all__ = ["converter", "structure_strict", "structure_options"]

#: The converter for user-facing config: unknown keys are errors.
converter = cattrs.Converter(forbid_extra_keys=True)


def _describe(exc: BaseException, where: str) -> list[str]:
    """Flatten a cattrs error tree into ``[table] key: problem`` lines."""
    lines: list[str] = []

    def walk(err: BaseException, path: str) -> None:
        if isinstance(err, ForbiddenExtraKeysError):
            for key in sorted(err.extra_fields):
                lines.append(f"{where}{path}{'.' if path else ' '}{key}: unknown key"
                             if path else f"{where} {key}: unknown key")
            return
        if isinstance(err, (ClassValidationError, IterableValidationError)):
            for sub in err.exceptions:
                note = _note_for(sub)
                walk(sub, f"{path}.{note}" if path and note else (note or path))
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


def _check_types(cls: type, data: Mapping[str, Any], where: str) -> None:
    """Reject values cattrs would silently coerce (``"5"`` for an int, 1 for a str)."""
    fields = {f.name: f for f in attrs.fields(cls)}
    for key, value in data.items():
        field = fields.get(key)
        if field is None:
            continue
        expected = field.type
        if isinstance(expected, str):
            expected = {"int": int, "float": float, "str": str, "bool": bool}.get(expected)
        if expected is bool and not isinstance(value, bool):
            raise ConfigError(f"{where} {key}: expected true or false, got {value!r}")
        if expected is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"{where} {key}: expected an integer, got {value!r}")
        if expected is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(f"{where} {key}: expected a number, got {value!r}")
        if expected is str and not isinstance(value, str):
            raise ConfigError(f"{where} {key}: expected a string, got {value!r}")


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
