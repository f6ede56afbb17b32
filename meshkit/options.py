"""Turning config tables into attrs options classes with cattrs, strictly.

Every error names the table and the key, so ``meshkit check`` can say
``config.toml: [aggregator] trim: expected float, got 'a lot'``, and an unknown
key says which known key it is closest to (``[strategy] runds: unknown key
(did you mean 'rounds'?)``). A key an options class no longer takes is named
with why and what instead: the class lists it in a ``retired_keys`` class
variable (``{"bf16_wire": "removed in ...; ..."}``), and the error reads
``[transport] bf16_wire: removed in ...``.
"""

from __future__ import annotations

import collections.abc
import difflib
import math
import re
import tomllib
import types
import typing
from typing import Any, Iterable, Mapping, Sequence

import attrs
import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError

from meshkit.errors import ConfigError, PluginError

__all__ = ["converter", "closest", "structure_strict", "structure_options", "positive",
           "non_negative", "parse_options", "finite", "finite_positive", "finite_non_negative",
           "count_at_least", "default_from", "defaults_from"]

def positive(instance: Any, attribute: Any, value: Any) -> None:
    """attrs validator: the option must be a finite number greater than zero."""
    # Written so NaN fails too (every comparison with NaN is false), and inf.
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{attribute.name} must be a finite number > 0, got {value}")


def non_negative(instance: Any, attribute: Any, value: Any) -> None:
    """attrs validator: the option must be a finite number, zero or more."""
    # -0.0 too: numpy's samplers read its sign bit as a negative scale.
    if not (value >= 0 and math.isfinite(value)) or math.copysign(1.0, value) < 0:
        raise ValueError(f"{attribute.name} must be a finite number >= 0, got {value}")


def finite(instance: Any, attribute: Any, value: Any) -> None:
    """attrs validator: the option must be a finite number (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{attribute.name} must be a finite number, got {value!r}")


def finite_positive(instance: Any, attribute: Any, value: Any) -> None:
    """attrs validator: a finite number greater than zero."""
    finite(instance, attribute, value)
    if not value > 0:
        raise ValueError(f"{attribute.name} must be a finite number > 0, got {value!r}")


def finite_non_negative(instance: Any, attribute: Any, value: Any) -> None:
    """attrs validator: a finite number of zero or more."""
    finite(instance, attribute, value)
    if value < 0:
        raise ValueError(f"{attribute.name} must be a finite number >= 0, got {value!r}")


def count_at_least(minimum: int) -> Any:
    """attrs validator factory: an integer (not a bool) of at least ``minimum``."""
    def check(instance: Any, attribute: Any, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{attribute.name} must be an integer >= {minimum}, got {value!r}")
    return check


#: The converter for user-facing config: unknown keys are errors.
converter = cattrs.Converter(forbid_extra_keys=True)


#: attrs field metadata key: the config key an option defaults to (:func:`default_from`).
_DEFAULT_FROM = "meshkit.default_from"


def default_from(table: str, key: str) -> dict[str, Any]:
    """attrs field metadata: left out of its table, this option takes ``[table] key``'s value.

    ``num_partitions: int = attrs.field(default=0, metadata=default_from("strategy",
    "clients"))``: a value the user would otherwise write twice, and could get
    wrong in one place. :func:`meshkit.train._coordinator.plan.resolve` fills it in (when
    ``[table] key`` is given) before the options are structured, and the filled
    table is what every node receives.
    """
    return {_DEFAULT_FROM: (table, key)}


def defaults_from(options_cls: type | None) -> dict[str, tuple[str, str]]:
    """Each field of ``options_cls`` declared with :func:`default_from`: name -> (table, key)."""
    if options_cls is None or not attrs.has(options_cls):
        return {}
    return {field.name: tuple(field.metadata[_DEFAULT_FROM])
            for field in attrs.fields(options_cls) if _DEFAULT_FROM in field.metadata}


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
    retired = getattr(cls, "retired_keys", None)
    if isinstance(retired, Mapping) and key in retired:
        return str(retired[key])
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
        named = _validator_key(err)
        if named is not None and not path.endswith(named):
            path = f"{path}.{named}" if path else named
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


def _validator_key(exc: BaseException) -> str | None:
    """The key an attrs built-in validator names in its error's arguments, if any.

    attrs' own validators (``in_``, ``ge``, ``instance_of``, ...) raise with
    ``args = (message, Attribute, ...)``; its ``str()`` is that whole tuple.
    """
    args: tuple[Any, ...] = tuple(getattr(exc, "args", ()))
    if len(args) > 1 and isinstance(args[0], str) and isinstance(args[1], attrs.Attribute):
        return str(args[1].name)
    # attrs' ``ge``/``le`` (and meshkit's own validators) say "'key' must ..." / "key must ...".
    if isinstance(exc, ValueError) and len(args) == 1 and isinstance(args[0], str):
        m = re.match(r"(?:Length of )?'?([A-Za-z_]\w*)'? must ", args[0])
        if m:
            return m.group(1)
    return None


def _problem(exc: BaseException) -> str:
    if isinstance(exc, KeyError):
        return "required key is missing"
    if isinstance(exc, (TypeError, ValueError)) and "required positional argument" in str(exc):
        return "required key is missing"
    if _validator_key(exc) is not None and len(exc.args) > 1:
        # One sentence, not the raw (message, Attribute, options, value) tuple.
        return f"invalid value: {exc.args[0]}"
    text = str(exc)
    if isinstance(exc, (ValueError, TypeError)) and text:
        return f"invalid value: {text}"
    return text or type(exc).__name__


_PRIMITIVES = {"int": int, "float": float, "str": str, "bool": bool}


def _field_types(cls: type, where: str) -> dict[str, Any]:
    """Field name -> type, resolved from string annotations.

    An annotation that cannot be resolved (a name only imported under
    ``TYPE_CHECKING``, a typo) would leave every value of the class unchecked,
    so it is the plugin's bug, a :class:`~meshkit.PluginError` naming it.
    """
    try:
        attrs.resolve_types(cls)
    except Exception as exc:  # NameError (a forward reference), TypeError (a bad annotation)
        raise PluginError(
            f"{where}: the options class {cls.__module__}.{cls.__qualname__} has an "
            f"annotation that cannot be resolved ({type(exc).__name__}: {exc}), so its "
            f"values cannot be checked; import the annotated types at module level") from exc
    return {f.name: f.type for f in attrs.fields(cls)}


def _check_types(cls: type, data: Mapping[str, Any], where: str, prefix: str = "") -> None:
    """Reject values cattrs would silently coerce (``"5"`` for an int, 1 for a str).

    Nested tables (``[[strategy.partitions]]``) are checked too: cattrs would
    otherwise turn ``rank = 1.9`` into rank 1 and ``nodes = "abc"`` into
    ``["a", "b", "c"]``.
    """
    types = _field_types(cls, where)
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
        key = _validator_key(exc)
        raise ConfigError(f"{where} {key}: {_problem(exc)}" if key else
                          f"{where}: {_problem(exc)}") from None


def structure_options(component: Any, data: Mapping[str, Any], *, where: str) -> Any:
    """Structure a component's options table (no keys allowed when it has none)."""
    if component.options is None:
        if data:
            keys = ", ".join(sorted(data))
            raise ConfigError(
                f"{where} {keys}: unknown key; {component.name!r} takes no options")
        return None
    return structure_strict(data, component.options, where=where)


#: What a ``KEY=VALUE`` value must read as, for a field of each plain type.
_EXPECTED = {int: "an integer", float: "a number", bool: "true or false"}


def _plain(annotation: Any) -> Any:
    """``int`` for ``int`` or ``int | None``; None for anything else but ``str``/``float``/``bool``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = options[0] if len(options) == 1 else None
    return annotation if annotation in (str, int, float, bool) else None


def _toml_value(raw: str) -> Any:
    """``raw`` read as a TOML value (``8``, ``0.5``, ``true``, ``[1, 2]``, ``"text"``), else itself."""
    try:
        return tomllib.loads(f"value = {raw}")["value"]
    except tomllib.TOMLDecodeError:
        return raw


def parse_options(pairs: Sequence[str], options_cls: type | None, *, flag: str,
                  table: str) -> dict[str, Any]:
    """Turn ``KEY=VALUE`` strings into a component options table, typed by ``options_cls``.

    A value is read with TOML's value grammar, as it would be written in
    the config's table: ``input_elems=8`` is the integer 8, ``scale=0.5`` a
    float, ``strict=true`` a boolean, ``sizes=[64, 32]`` an array,
    ``name="a b"`` a string; what TOML cannot read is the bare string
    (``function=affine``, ``train_csv=/data/a.csv``). A field declared
    ``str`` keeps its text as given (``stage_id=007`` is ``"007"``); one
    declared ``int``, ``float`` or ``bool`` must read as one, or it is a
    :class:`ConfigError` naming the key. Unknown keys are passed through for
    the options class to refuse with its own message.
    """
    types_of = _field_types(options_cls, table) if options_cls is not None else {}
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"{flag} {pair!r}: expected KEY=VALUE")
        if key in options:
            raise ConfigError(f"{flag} {key}: given twice")
        value = _toml_value(raw)
        expected = _plain(types_of.get(key))
        if expected is str and not isinstance(value, str):
            value = raw
        elif expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if expected in _EXPECTED and (type(value) is not expected):
            raise ConfigError(f"{table} {key}: expected {_EXPECTED[expected]}, got {raw!r}")
        options[key] = value
    return options
