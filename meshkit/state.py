"""The state model every component shares: ``name -> numpy array | JSON value``.

A *state* is a mapping from a non-empty string key to either a numpy array
(a parameter, a buffer, a gradient) or a JSON value (number, string, bool,
None, list, dict with string keys) such as a Python filter's ``{"mu": 1.5}``.

This module holds the validation helpers the aggregators, the outer
optimizers, the wire codec and the tasks use, so every component agrees on
what a valid state is:

* :func:`validate_state` checks keys, array dtypes, JSON leaves and
  (by default) finiteness, and names the offending key;
* :func:`is_json_value` / :func:`is_json_leaf` / :func:`is_array` classify
  values;
* dtype helpers: :data:`BFLOAT16` (ml_dtypes' bfloat16, the numpy bf16 JAX
  and TensorFlow use), :func:`is_float_dtype`, :func:`accumulate_dtype`,
  :func:`dtype_name` / :func:`dtype_from_name` for a portable dtype spelling.

Dtypes a state may carry: float16, bfloat16, float32, float64, the signed
and unsigned integers of 8 to 64 bits, and bool. Complex, object, string
and datetime arrays are refused: nothing in meshkit can average, send or
step them honestly.
"""

from __future__ import annotations

from collections import abc
import math
from typing import Any, Callable, Iterator, Mapping, Union

import ml_dtypes
import numpy as np

from meshkit.errors import StateError

__all__ = [
    "State",
    "nonfinite_keys",
    "JsonValue",
    "StateError",
    "BFLOAT16",
    "INT_BUFFERS",
    "FLOAT_DTYPES",
    "FLOAT_DTYPE_SET",
    "ARRAY_TYPES",
    "SUPPORTED_DTYPES",
    "is_array",
    "is_json_leaf",
    "is_json_value",
    "is_float_dtype",
    "is_supported_dtype",
    "update_keys",
    "accumulate_dtype",
    "dtype_name",
    "dtype_from_name",
    "check_key",
    "validate_state",
    "copy_state",
    "iter_json_numbers",
    "state_nbytes",
]

JsonValue = Union[None, bool, int, float, str, list, dict]
#: A model state: parameter/buffer name -> numpy array or JSON value.
State = Mapping[str, Any]


#: bfloat16 as a real numpy dtype (ml_dtypes, the field's standard numpy bf16).
BFLOAT16: np.dtype = np.dtype(ml_dtypes.bfloat16)

#: The JSON leaf of a state listing integer buffers carried as float64 counts,
#: ``{key: dtype name}`` (:mod:`meshkit.torch` writes it; exports read it back).
INT_BUFFERS = "meshkit.torch:int_buffers"

#: Floating dtypes meshkit averages and steps.
FLOAT_DTYPES: tuple[np.dtype, ...] = (
    np.dtype(np.float16), BFLOAT16, np.dtype(np.float32), np.dtype(np.float64))

_INT_DTYPES: tuple[np.dtype, ...] = tuple(np.dtype(t) for t in (
    np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64))

#: Every dtype a state array may have.
SUPPORTED_DTYPES: tuple[np.dtype, ...] = (*FLOAT_DTYPES, *_INT_DTYPES, np.dtype(np.bool_))
#: :data:`FLOAT_DTYPES` as a set: what a hot per-key path asks inline, with no call a key.
FLOAT_DTYPE_SET: frozenset[np.dtype] = frozenset(FLOAT_DTYPES)
#: What :func:`is_array` tests, for the same inline use.
ARRAY_TYPES: tuple[type[np.ndarray], type[np.generic]] = (np.ndarray, np.generic)

_BY_NAME: dict[str, np.dtype] = {dtype_.name: dtype_ for dtype_ in SUPPORTED_DTYPES}
# ml_dtypes names its dtype "bfloat16" already; keep the lookup explicit anyway.
_BY_NAME["bfloat16"] = BFLOAT16


def is_array(value: Any) -> bool:
    """True for a numpy array or numpy scalar (a 0-d value with a dtype)."""
    return isinstance(value, ARRAY_TYPES)


#: Deepest nesting of lists/objects a JSON value may have. Far beyond any
#: real config or metric, and far below Python's recursion limit, so code that
#: walks a JSON value recursively (folds, validation) can never overflow it.
MAX_JSON_DEPTH = 64


def json_depth(value: Any) -> int:
    """Nesting depth of a JSON value (a leaf is 0), computed without recursion."""
    depth, stack = 0, [(value, 0)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, (list, dict)):
            level += 1
            depth = max(depth, level)
            if level > MAX_JSON_DEPTH:
                return level  # deep enough to refuse; no need to walk the rest
            stack.extend((v, level) for v in (node.values() if isinstance(node, dict) else node))
    return depth


def is_json_leaf(value: Any) -> bool:
    """True for a JSON scalar: None, bool, int, float or str (not a numpy scalar)."""
    return value is None or type(value) in (bool, int, float, str)


def is_json_value(value: Any) -> bool:
    """True for a JSON value: a leaf, or lists/dicts (string keys) of JSON values."""
    if is_json_leaf(value):
        return True
    if isinstance(value, list):
        return all(is_json_value(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_json_value(v) for k, v in value.items())
    return False


def nonfinite_keys(state: Mapping[str, Any]) -> list[str]:
    """The keys of ``state`` whose float array holds a NaN or an infinity, in key order."""
    # is_array and is_float_dtype written out: asked of every round's new model, two
    # calls a key fewer (issue 36).
    return [str(key) for key, value in state.items()
            if isinstance(value, ARRAY_TYPES) and value.dtype in FLOAT_DTYPE_SET
            and not _all_finite(value)]


def is_float_dtype(dtype: Any) -> bool:
    """True for float16, bfloat16, float32 and float64.

    ``np.issubdtype(bfloat16, np.floating)`` is False (ml_dtypes registers
    bfloat16 outside numpy's type hierarchy), so always ask this instead.
    """
    return np.dtype(dtype) in FLOAT_DTYPE_SET


def update_keys(state: Mapping[str, Any]) -> list[str]:
    """The keys a round clips and sums as an update where nothing else may be released
    (secure aggregation, differential privacy), sorted: the floating-point arrays,
    bfloat16 included, less the integer buffers the state carries as float64 counts
    (its :data:`INT_BUFFERS` leaf, e.g. BatchNorm's ``num_batches_tracked``).

    A count is not an update: clipped like one it would gain at most the clip range a
    round. It keeps the global model's value, as an integer array and a JSON leaf do.
    """
    counts = state.get(INT_BUFFERS)
    skip = counts if isinstance(counts, Mapping) else {}
    return sorted(key for key, value in state.items()
                  if isinstance(value, np.ndarray) and is_float_dtype(value.dtype)
                  and key not in skip)


def is_supported_dtype(dtype: Any) -> bool:
    """True for every dtype a state array may carry (floats, integers, bool)."""
    try:
        return np.dtype(dtype) in SUPPORTED_DTYPES
    except TypeError:
        return False


def accumulate_dtype(dtype: Any, *, wide: bool = False) -> np.dtype:
    """The dtype sums of ``dtype`` arrays are accumulated in.

    float16 and bfloat16 accumulate in float32 (their 8-11 bit mantissas
    would lose a contribution's low bits after a few additions); float32
    accumulates in float32 and float64 in float64. ``wide=True`` asks for
    float64 for every float dtype, trading 2x the accumulator memory and
    bandwidth for precision (see docs/aggregators.md for the measurements
    behind the default).
    """
    dtype = np.dtype(dtype)
    if not is_float_dtype(dtype):
        raise StateError(f"no accumulation dtype for {dtype_name(dtype)}: only float arrays "
                         f"are summed (integer and bool arrays must agree exactly)")
    if wide or dtype == np.float64:
        return np.dtype(np.float64)
    return np.dtype(np.float32)


def dtype_name(dtype: Any) -> str:
    """A portable name for ``dtype`` ("float32", "bfloat16", ...)."""
    dtype = np.dtype(dtype)
    if dtype == BFLOAT16:
        return "bfloat16"
    return dtype.name


def dtype_from_name(name: str) -> np.dtype:
    """The dtype for a portable name; a :class:`StateError` listing the names otherwise."""
    dtype = _BY_NAME.get(name)
    if dtype is None:
        raise StateError(f"unsupported dtype {name!r}; a state array may be one of: "
                         f"{', '.join(sorted(_BY_NAME))}")
    return dtype


def check_key(key: Any, *, where: str = "state") -> None:
    """A state key must be a non-empty string."""
    if not isinstance(key, str):
        raise StateError(f"{where}: keys must be strings, found {key!r} "
                         f"({type(key).__name__}); rename the entry")
    if not key:
        raise StateError(f"{where}: found an empty key; every entry needs a name")


def validate_state(
    state: Any,
    *,
    where: str = "state",
    allow_nonfinite: bool = False,
    error: Callable[[str], Exception] = StateError,
) -> None:
    """Check ``state`` against the state model; raise ``error(message)`` otherwise.

    Checks: ``state`` is a mapping; every key is a non-empty string; every
    value is a numpy array of a supported dtype or a JSON value; unless
    ``allow_nonfinite``, no float array or JSON number holds NaN or inf.
    The finiteness check reads every float array once; components on a hot
    path (the streaming fold) check finiteness themselves, chunk by chunk.
    """
    if type(state) is not dict and not isinstance(state, abc.Mapping):
        raise error(f"{where}: expected a mapping of name -> array or JSON value, "
                    f"found {type(state).__name__}")
    for key, value in state.items():
        try:
            check_key(key, where=where)
        except StateError as exc:
            raise error(str(exc)) from None
        if not is_array(value) and json_depth(value) > MAX_JSON_DEPTH:
            raise error(f"{where} {key!r}: JSON nested more than {MAX_JSON_DEPTH} levels "
                        f"deep; flatten it")
        _validate_value(value, f"{where} {key!r}", allow_nonfinite, error)


def _validate_value(value: Any, label: str, allow_nonfinite: bool,
                    error: Callable[[str], Exception]) -> None:
    if is_array(value):
        dtype = value.dtype
        if not is_supported_dtype(dtype):
            raise error(f"{label}: arrays of dtype {dtype} are not supported; use one of "
                        f"{', '.join(sorted(_BY_NAME))}")
        if not allow_nonfinite and is_float_dtype(dtype) and not _all_finite(value):
            raise error(f"{label}: contains NaN or inf; non-finite values are refused "
                        f"(a diverged model must not be averaged into the others)")
        return
    if is_json_leaf(value):
        if type(value) is float and not allow_nonfinite and not math.isfinite(value):
            raise error(f"{label}: the JSON number {value!r} is not finite; non-finite "
                        f"values are refused")
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _validate_value(item, f"{label}[{i}]", allow_nonfinite, error)
        return
    if isinstance(value, dict):
        for k, item in value.items():
            if not isinstance(k, str):
                raise error(f"{label}: JSON object keys must be strings, found {k!r}")
            _validate_value(item, f"{label}.{k}", allow_nonfinite, error)
        return
    raise error(f"{label}: expected a numpy array or a JSON value (number, string, bool, "
                f"None, list, dict), found {type(value).__name__}; convert it (e.g. "
                f"tensor.numpy(), or list(...) for a tuple)")


#: Elements a finiteness scan tests at a time: its scratch is this many bools (and, for
#: a half-precision array, this many float32), whatever the array's size.
_SCAN_CHUNK = 1 << 16


def _all_finite(array: Any) -> bool:
    """Whether a float array holds no NaN or infinity, scanned in chunks of
    :data:`_SCAN_CHUNK` into one small scratch (never a whole array of bools, nor of
    float32 for a half-precision one)."""
    array = np.asarray(array)
    widen = array.dtype == BFLOAT16 or array.dtype == np.float16
    if array.size <= _SCAN_CHUNK and not widen:
        # One chunk's worth (a small model's every key, each round): one test, its bools
        # no more than the scratch the loop below would make.
        return bool(np.isfinite(array).all())
    flat = array.ravel(order="K")  # a view unless the array is not contiguous
    if not np.shares_memory(flat, array) and array.size:
        return bool(np.isfinite(array).all())  # rare: a strided view, copied once anyway
    # Half precision is widened chunk by chunk: ml_dtypes' isfinite on bf16 is slow.
    scratch = np.empty(min(flat.size, _SCAN_CHUNK), dtype=bool)
    wide = np.empty(scratch.size, dtype=np.float32) if widen else None
    for start in range(0, flat.size, _SCAN_CHUNK):
        chunk = flat[start:start + _SCAN_CHUNK]
        n = chunk.size
        if wide is not None:
            chunk = wide[:n]
            chunk[...] = flat[start:start + n]
        np.isfinite(chunk, out=scratch[:n])
        if not scratch[:n].all():
            return False
    return True


def copy_state(state: State) -> dict[str, Any]:
    """A deep copy: arrays copied (same dtype), JSON containers rebuilt."""
    return {key: _copy_value(value) for key, value in state.items()}


def _copy_value(value: Any) -> Any:
    if is_array(value):
        return np.array(value, copy=True)
    if isinstance(value, list):
        return [_copy_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _copy_value(v) for k, v in value.items()}
    return value


def iter_json_numbers(value: Any, label: str = "") -> Iterator[tuple[str, float]]:
    """Every number (not bool) inside a JSON value, with its path."""
    if type(value) in (int, float):
        yield label, value
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from iter_json_numbers(item, f"{label}[{i}]")
    elif isinstance(value, dict):
        for k, item in value.items():
            yield from iter_json_numbers(item, f"{label}.{k}" if label else k)


def state_nbytes(state: State) -> int:
    """Bytes held by the arrays of ``state`` (JSON values not counted)."""
    return sum(int(v.nbytes) for v in state.values() if is_array(v))
