"""The outer-optimizer contract and the helpers the built-ins share.

An *outer optimizer* steps the global model from a round's consensus before
it is scattered back (DiLoCo, FedOpt)::

    new_global = optimizer.step(global_state, consensus)
    checkpoint = optimizer.state_dict()      # a state: JSON values + arrays
    optimizer.load_state_dict(checkpoint)    # continues bit for bit

One sign convention throughout: the pseudo-gradient is
``g = global - consensus`` and every optimizer descends on it
(``x <- x - lr * direction(g)``), so ``lr = 1`` with no momentum adopts the
consensus.

What an optimizer receives (the kernel's rule, :func:`step_parameters`, the
same for every optimizer, third-party ones included): only the model's
*parameters*, i.e. its float arrays that the task does not mark as buffers
(``task.buffers()``: BatchNorm's running statistics, counters). Buffers,
integer and bool arrays and JSON values never reach ``step``: they take the
consensus, in the global model's dtype. A momentum or adaptive step applied
to a running variance can drive it negative; a float step applied to an
integer counter cannot be stored in it. Dtype policy: the moments are kept in :func:`meshkit.state.accumulate_dtype`
of the parameter (float32 for float16/bfloat16/float32, float64 for
float64), the step is computed in that dtype, and the new global comes back
in the global parameter's dtype.
"""

from __future__ import annotations

from typing import Any, Collection, Mapping, Protocol, runtime_checkable

import numpy as np

from meshkit.errors import AggregationError
from meshkit.state import FLOAT_DTYPE_SET, State, StateError, dtype_name, is_array, is_float_dtype

__all__ = [
    "OuterOptimizer",
    "step_parameters",
    "parameter_keys",
    "stepped_keys",
    "pseudo_gradient",
    "split_buffers",
    "join_buffers",
]


@runtime_checkable
class OuterOptimizer(Protocol):
    """What the coordinator needs from an outer optimizer."""

    def step(self, global_state: State, consensus: State) -> dict[str, Any]:
        """The new global model from the current one and the round's consensus."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: a state (JSON values + arrays)."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


def parameter_keys(global_state: State, consensus: State, *,
                   buffers: Collection[str] = (), name: str = "outer") -> list[str]:
    """The keys an outer optimizer receives: float arrays that are not ``buffers``.

    Checks the pair first as :func:`stepped_keys` does (same keys, float
    arrays of one shape on both sides), so a mismatch is an
    :class:`AggregationError` naming the key whoever steps.
    """
    skip = frozenset(buffers)
    return [k for k in stepped_keys(global_state, consensus, name=name) if k not in skip]


def step_parameters(optimizer: Any, global_state: State, consensus: State, *,
                    buffers: Collection[str] = (), name: str = "outer") -> dict[str, Any]:
    """One outer step by the kernel's rule: the optimizer sees the parameters only.

    ``optimizer.step`` receives the global model's and the consensus's
    parameters (:func:`parameter_keys`) and must return exactly those keys.
    Every other key -- the task's ``buffers``, integer and bool arrays, JSON
    values -- takes the consensus, an array cast back to the global model's
    dtype. Numpy scalars go in and come out as 0-d arrays. The result keeps the
    global model's key order.
    """
    params = parameter_keys(global_state, consensus, buffers=buffers, name=name)
    # numpy scalars (np.float32(1.5)) in, and out, as 0-d arrays: the wire
    # carries arrays, and an optimizer writing out= into one needs an array.
    stepped = _as_arrays(optimizer.step(_as_arrays(global_state, params),
                                        _as_arrays(consensus, params)))
    if set(stepped) != set(params):
        missing = sorted(set(params) - set(stepped))
        extra = sorted(set(stepped) - set(params))
        raise AggregationError(
            f"outer optimizer {name}: step() must return exactly the parameters it was "
            f"given; missing {missing or 'none'}, unexpected {extra or 'none'}")
    out: dict[str, Any] = {}
    for key, x in global_state.items():
        if key in stepped:
            out[key] = stepped[key]
            continue
        c = consensus[key]
        if is_array(x) and is_array(c):
            # A numpy scalar cannot go on the wire: every array leaf is an ndarray.
            c = np.asarray(c)
            if c.dtype != np.asarray(x).dtype:
                c = c.astype(np.asarray(x).dtype)
        out[key] = c
    return out


def _as_arrays(state: State, keys: Collection[str] | None = None) -> dict[str, Any]:
    """``state``'s ``keys`` (default: all), numpy scalars as 0-d arrays (one call a
    state, not one a key: issue 36)."""
    if keys is None:
        keys = state.keys()
    generic = np.generic
    return {k: np.asarray(v) if isinstance(v, generic) else v
            for k in keys for v in (state[k],)}


def stepped_keys(global_state: State, consensus: State, *, name: str) -> list[str]:
    """The keys an optimizer steps (float arrays), after checking the pair agrees.

    Global and consensus must have the same keys; a float array must be a
    float array of the same shape on both sides (the dtypes may differ,
    e.g. a bfloat16 consensus for a float32 global). Anything wrong is an
    :class:`AggregationError` naming the key.
    """
    missing = [k for k in global_state if k not in consensus]
    extra = [k for k in consensus if k not in global_state]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"the consensus lacks {', '.join(map(repr, missing))}")
        if extra:
            parts.append(f"the consensus has {', '.join(map(repr, extra))} the global "
                         f"model does not")
        raise AggregationError(
            f"outer optimizer {name}: {'; '.join(parts)}; the consensus must have exactly "
            f"the global model's keys")
    keys = []
    for key, x in global_state.items():
        c = consensus[key]
        if type(x) is np.ndarray and type(c) is np.ndarray:
            # The common case, checked without a call per test (issue 36: this runs
            # twice a round): the same contract as the general path below.
            x_float = x.dtype in FLOAT_DTYPE_SET
            if x_float and c.dtype in FLOAT_DTYPE_SET:
                if x.shape != c.shape:
                    raise AggregationError(
                        f"outer optimizer {name}: {key!r} has shape {x.shape} in the global "
                        f"model but {c.shape} in the consensus")
                keys.append(key)
                continue
            if not x_float and c.dtype not in FLOAT_DTYPE_SET:
                continue
        x_float = is_array(x) and is_float_dtype(x.dtype)
        c_float = is_array(c) and is_float_dtype(c.dtype)
        if x_float != c_float:
            what = {True: "a float array", False: "not a float array"}
            raise AggregationError(
                f"outer optimizer {name}: {key!r} is {what[x_float]} in the global model but "
                f"{what[c_float]} in the consensus")
        if not x_float:
            continue
        if np.shape(x) != np.shape(c):
            raise AggregationError(
                f"outer optimizer {name}: {key!r} has shape {np.shape(x)} in the global model "
                f"but {np.shape(c)} in the consensus")
        keys.append(key)
    return keys


def pseudo_gradient(x: np.ndarray, c: np.ndarray, dtype: Any) -> np.ndarray:
    """``g = x - c`` computed in ``dtype`` (a new array)."""
    g = np.asarray(x).astype(dtype, copy=True)
    np.subtract(g, np.asarray(c).astype(dtype, copy=False), out=g)
    return g


def split_buffers(state: Mapping[str, Any], buffers: tuple[str, ...], *,
                  name: str) -> dict[str, dict[str, np.ndarray]]:
    """``{"m/w": a, "v/w": b}`` -> ``{"m": {"w": a}, "v": {"w": b}}`` (arrays copied).

    A writable ``numpy.memmap`` is adopted, not copied: the spill
    (:mod:`meshkit.spill`) hands an optimizer its moments mapped from a file, to be
    stepped in place there rather than held in memory.
    """
    out: dict[str, dict[str, np.ndarray]] = {b: {} for b in buffers}
    for full_key, value in state.items():
        prefix, sep, key = full_key.partition("/")
        if not sep or prefix not in out:
            continue
        if not is_array(value) or not is_float_dtype(value.dtype):
            raise StateError(
                f"outer optimizer {name}: state entry {full_key!r} must be a float array, "
                f"found {type(value).__name__}"
                f"{' ' + dtype_name(value.dtype) if is_array(value) else ''}")
        out[prefix][key] = value if _spilled(value) else np.array(value, copy=True)
    return out


def _spilled(value: Any) -> bool:
    return isinstance(value, np.memmap) and value.mode == "r+"


def join_buffers(buffers: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The inverse of :func:`split_buffers` (arrays copied, so later steps can't change it).

    A spilled buffer (a writable map, see :func:`split_buffers`) is handed out as the
    map itself: it is the file, and copying it would bring the moments back into memory;
    the checkpoint writer reads it before the next step changes it.
    """
    return {f"{prefix}/{key}": value if _spilled(value) else np.array(value, copy=True)
            for prefix, table in buffers.items() for key, value in table.items()}
