"""The trainer protocol's schema language: bounds, value types, field declarations, one converter.

Every message family (:mod:`.trainer`, :mod:`.secure`, :mod:`.relay`)
declares its attrs classes with :func:`_field` and the checks below, and
is structured by the one cattrs converter :data:`CONVERTER` built here
(``forbid_extra_keys``; no coercion: ``"3"`` is not an int, ``True`` is not
a number). Where a message is checked is :mod:`.check`.
"""

from __future__ import annotations

from collections import abc
import math
from typing import Any, Callable, Iterator, Mapping, NewType

import attrs
import cattrs
import numpy as np

from meshkit.secure_aggregation import MAX_CLIENT_ID, MAX_CLIENTS, MAX_LENGTH


# -- bounds ------------------------------------------------------------------------------

#: The most examples one reply may claim: exactly representable as a float64.
MAX_EXAMPLES = 2 ** 53
#: The most entries a state (a model, gradients) may have.
MAX_STATE_KEYS = 1 << 20
#: The longest state key, metric name or stage node name (characters).
MAX_NAME = 1024
#: The most metrics one reply may carry.
MAX_METRICS = 256
#: The longest error message a worker may send (characters).
MAX_ERROR = 1 << 16
#: Shards, clients, ranks and stage nodes: at most this many.
MAX_COUNT = 1 << 31
#: The longest time budget a fit may be given (seconds: about four months).
MAX_BUDGET = 1e7
#: The most fits one ``fit_batch`` may carry (the engine sends far fewer).
MAX_BATCH = 4096
#: Seeds are unsigned 64-bit integers.
MAX_SEED = 2 ** 64 - 1
#: Kept-result keys are integers 0..MAX_SEQ; sequence numbers signed 64-bit
#: integers (a host relay numbers its own requests below zero).
MAX_SEQ = 2 ** 63 - 1
MIN_SEQ = -(2 ** 63)

# -- the value types beyond JSON's -----------------------------------------------------------

#: A model state: ``name -> array | JSON value`` (docs/protocol.md: "state").
State = NewType("State", dict)
#: Task metrics: ``name -> finite number``.
Metrics = NewType("Metrics", dict)
#: A pipeline activation: an array (or a JSON number or list).
Activation = NewType("Activation", object)
#: A simulated attacker's data poisoning: ``{"name": ATTACK, "options": {key: JSON value}}``.
Poison = NewType("Poison", dict)
#: ``[compression]``: ``{"name": COMPRESSOR, "options": {key: JSON value}, "raw": [keys]}``,
#: and in a grid batch (``fit_batch``) ``"clip_range": float``; with ``[compression] residual =
#: "worker"`` a fit's ``"residual": {"client": int, "from": seed?}`` (the residual the fit
#: seeded ``from`` left on this worker is fed back; without ``from``, none).
Compress = NewType("Compress", dict)

#: Secure aggregation (``secagg_*``): client ids, sorted and distinct.
ClientIds = NewType("ClientIds", list)
#: Secure aggregation: a list of integers (ids in any order, seeds, kinds).
Integers = NewType("Integers", list)
#: Secure aggregation: rows of bytes, a 2-d uint8 array (one key, share or sealed share a row).
Rows = NewType("Rows", object)
#: Secure aggregation: a masked vector, 1-d uint32 or uint64 (integers mod 2**modulus_bits),
#: or uint8 when packed at modulus_bits bits an element (meshkit.secure_aggregation.to_wire).
Masked = NewType("Masked", object)

_JSON_LEAVES = (int, float, str, bool, type(None), list, dict)
#: What a state's value may be: an array or a JSON value.
_STATE_LEAVES = (np.ndarray, *_JSON_LEAVES)


def _integer(value: Any, _: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"expected an integer, got {_shown(value)}")
    return int(value)


def _number(value: Any, _: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"expected a number, got {_shown(value)}")
    return float(value)


def _boolean(value: Any, _: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"expected a bool, got {_shown(value)}")
    return bool(value)


def _string(value: Any, _: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {_shown(value)}")
    return value


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME:
        raise ValueError(f"{what} must be a string of 1 to {MAX_NAME} characters, got "
                         f"{_shown(value)}")
    return value


def _named(value: Any, expected: str, most: int, counted: str,
           key: str) -> Iterator[tuple[str, Any]]:
    """``value``'s entries, checked as they are read: a mapping of at most ``most`` entries
    (``counted`` says how many it has, ``{}`` the count), each key a name (``key`` says
    which in errors)."""
    if type(value) is not dict and not isinstance(value, abc.Mapping):
        raise TypeError(f"expected {expected}, got {_shown(value)}")
    if len(value) > most:
        raise ValueError(f"{counted.format(len(value))}; at most {most}")
    for name, leaf in value.items():
        _name(name, key)
        yield name, leaf


def _listed(value: Any, expected: str, most: int, counted: str) -> list[int]:
    """``value``, a list of at most ``most`` integers (``counted``: how many it has)."""
    if not isinstance(value, list):
        raise TypeError(f"expected {expected}, got {_shown(value)}")
    if len(value) > most:
        raise ValueError(f"{counted.format(len(value))}; at most {most}")
    if all(type(v) is int for v in value):
        # Plain ints (bool is not one) pass as they are, what _integer would return: a
        # round's lists hold ~10**4 of them.
        return list(value)
    return [_integer(v, None) for v in value]


def _state(value: Any, _: Any) -> Mapping[str, Any]:
    # _named's checks, inlined: every request and reply that carries a model comes
    # through here, key by key (the generator and a tuple a key cost ~30% of a check).
    if type(value) is not dict and not isinstance(value, abc.Mapping):
        raise TypeError(f"expected a state (name -> array or JSON value), got "
                        f"{_shown(value)}")
    if len(value) > MAX_STATE_KEYS:
        raise ValueError(f"a state of {len(value)} entries; at most {MAX_STATE_KEYS}")
    for key, leaf in value.items():
        if type(key) is not str or not 0 < len(key) <= MAX_NAME:
            _name(key, "a state key")  # raises, but for a str subclass of a good length
        if not isinstance(leaf, _STATE_LEAVES):
            raise TypeError(f"state key {key!r} holds {_shown(leaf)}, not an array or a "
                            f"JSON value")
    return value


def _metrics(value: Any, _: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, number in _named(value, "metrics (name -> number)", MAX_METRICS, "{} metrics",
                               "a metric name"):
        if isinstance(number, bool) or not isinstance(number, (int, float, np.number)):
            raise TypeError(f"metric {name!r} is {_shown(number)}, not a number")
        if not math.isfinite(float(number)):
            raise ValueError(f"metric {name!r} is {float(number)!r}; metrics must be finite")
        out[name] = float(number)
    return out


def _choice(value: Any, what: str) -> dict[str, Any]:
    """A plugin chosen by a request, ``{name, options}``: its name and JSON options checked."""
    _name(value["name"], f"the {what}'s name")
    options = value.get("options") or {}
    if not isinstance(options, abc.Mapping) or len(options) > MAX_METRICS:
        raise ValueError(f"the {what}'s options must be an object of at most {MAX_METRICS} "
                         f"entries, got {_shown(options)}")
    for key, leaf in options.items():
        _name(key, f"an {what} option" if what[0] in "aeiou" else f"a {what} option")
        if not isinstance(leaf, _JSON_LEAVES):
            raise TypeError(f"{what} option {key!r} is {_shown(leaf)}, not a JSON value")
    return {"name": value["name"], "options": dict(options)}


def _poison(value: Any, _: Any) -> dict[str, Any]:
    if not isinstance(value, abc.Mapping) or "name" not in value or set(value) - {"name", "options"}:
        raise TypeError(f"expected an attack {{name, options}}, got {_shown(value)}")
    return _choice(value, "attack")


def _compress(value: Any, _: Any) -> dict[str, Any]:
    if not isinstance(value, abc.Mapping) or not {"name", "options", "raw"} <= set(value) \
            or set(value) - {"name", "options", "raw", "clip_range", "residual"}:
        raise TypeError(f"expected a compressor {{name, options, raw, clip_range?, "
                        f"residual?}}, got {_shown(value)}")
    raw = value["raw"]
    if not isinstance(raw, list) or len(raw) > MAX_STATE_KEYS:
        raise TypeError(f"the keys sent whole must be a list of at most {MAX_STATE_KEYS} "
                        f"names, got {_shown(raw)}")
    out = {**_choice({k: value[k] for k in ("name", "options")}, "compressor"),
           "raw": [_name(k, "a key sent whole") for k in raw]}
    if "clip_range" in value:  # a worker's one sum on the shared grid (CodeSum)
        c = value["clip_range"]
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 < c < 1e300:
            raise ValueError(f"clip_range must be a positive number, got {_shown(c)}")
        out["clip_range"] = float(c)
    if "residual" in value:  # error feedback's residual kept on this worker
        out["residual"] = _residual_field(value["residual"])
    return out


def _residual_field(value: Any) -> dict[str, int]:
    """A fit's ``compress.residual``: which client, and the seed of the fit whose residual
    this one feeds back (docs/protocol.md)."""
    if not isinstance(value, abc.Mapping) or "client" not in value \
            or set(value) - {"client", "from"}:
        raise TypeError(f"expected a residual {{client, from?}}, got {_shown(value)}")
    out = {}
    for name, high in (("client", MAX_COUNT), ("from", MAX_SEED)):
        if name in value:
            v = value[name]
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= high:
                raise ValueError(f"residual {name} must be an integer 0..{high}, got "
                                 f"{_shown(v)}")
            out[name] = int(v)
    return out

def _client_ids(value: Any, _: Any) -> list[int]:
    ids = _listed(value, "a list of client ids", MAX_CLIENTS, "{} client ids")
    if any(not 0 <= v <= MAX_CLIENT_ID for v in ids) or ids != sorted(set(ids)):
        raise ValueError(f"client ids must be distinct integers 0..{MAX_CLIENT_ID}, ascending")
    return ids


def _integers(value: Any, _: Any) -> list[int]:
    return _listed(value, "a list of integers", MAX_COUNT, "{} integers")


def _rows(value: Any, _: Any) -> np.ndarray:
    if not isinstance(value, np.ndarray) or value.dtype != np.uint8 or value.ndim != 2:
        raise TypeError(f"expected rows of bytes (a 2-d uint8 array), got {_shown(value)}")
    return value


def _masked(value: Any, _: Any) -> np.ndarray:
    if not isinstance(value, np.ndarray) or value.ndim != 1 or value.dtype not in (
            np.dtype(np.uint32), np.dtype(np.uint64), np.dtype(np.uint8)) \
            or not 0 < value.size <= 8 * MAX_LENGTH:
        raise TypeError(f"expected a masked vector (a 1-d uint32 or uint64 array of 1 to "
                        f"{MAX_LENGTH} elements, or one packed into uint8), got "
                        f"{_shown(value)}")
    return value


def _activation(value: Any, _: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (np.ndarray, list, int, float)):
        raise TypeError(f"expected an activation (an array), got {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    """A value as an error message shows it: its type, and the value when it is short."""
    if isinstance(value, np.ndarray):
        return f"an array {value.dtype}{list(value.shape)}"
    if isinstance(value, (bool, int, float, str, type(None))):
        text = repr(value)
        if len(text) <= 40:
            return f"{type(value).__name__} {text}"
    return type(value).__name__


#: Each value type and the check that structures it (no coercion).
_HOOKS: dict[Any, Callable[[Any, Any], Any]] = {
    int: _integer, float: _number, str: _string, bool: _boolean, State: _state,
    Metrics: _metrics, Activation: _activation, Poison: _poison, Compress: _compress,
    ClientIds: _client_ids, Integers: _integers, Rows: _rows, Masked: _masked,
}


def _converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True)
    for kind, hook in _HOOKS.items():
        converter.register_structure_hook(kind, hook)
    return converter


# -- fields ------------------------------------------------------------------------------------


def _between(low: float, high: float) -> Callable[[Any, Any, Any], None]:
    def check(_: Any, attribute: Any, value: Any) -> None:
        if not low <= value <= high:
            raise ValueError(f"{attribute.name} = {value!r} is out of range [{low}, {high}]")
    return check


def _length(low: int, high: int) -> Callable[[Any, Any, Any], None]:
    def check(_: Any, attribute: Any, value: Any) -> None:
        if not low <= len(value) <= high:
            raise ValueError(f"{attribute.name} has {len(value)} characters; {low} to {high} "
                             f"are allowed")
    return check


def _field(wire: str, doc: str, *, optional: bool = False, default: Any = attrs.NOTHING,
           check: Callable[[Any, Any, Any], None] | None = None) -> Any:
    """A message field: its wire type and meaning (docs/protocol.md shows both)."""
    validator = None if check is None else (attrs.validators.optional(check) if optional
                                            else check)
    if optional and default is attrs.NOTHING:
        default = None
    return attrs.field(default=default, validator=validator,
                       metadata={"wire": wire, "doc": doc})


def _seq(default: Any = attrs.NOTHING) -> Any:
    return _field("int -2^63..2^63-1", "the request's ticket, echoed by its reply (a host "
                  "relay numbers its own below 0)", default=default,
                  check=_between(MIN_SEQ, MAX_SEQ))


def _shard() -> Any:
    return _field("int 0..shards-1", "which shard (client) of `shards`",
                  check=_between(0, MAX_COUNT))


def _shards() -> Any:
    return _field("int 1..2^31", "how many shards the training (or held-out) set is cut into",
                  check=_between(1, MAX_COUNT))


def _examples(doc: str) -> Any:
    return _field("int 0..2^53", doc, check=_between(0, MAX_EXAMPLES))


def _in_order(message: Any) -> None:
    if message.shard >= message.shards:
        raise ValueError(f"shard {message.shard} of {message.shards}: shard must be below "
                         f"shards")


CONVERTER = _converter()
