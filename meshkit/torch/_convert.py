"""state_dict <-> meshkit state: no copies for CPU tensors, every dtype kept.

The rule of this module: a tensor and its numpy array share memory
(``tensor.numpy()`` one way, ``torch.from_numpy`` the other) unless the
tensor lives on another device, which only a copy can bring to the host.
bfloat16, which numpy lacks, crosses as ml_dtypes' bfloat16 by viewing the
same two bytes as int16 on both sides, so no value is ever rounded through
float32.

**Integer buffers.** BatchNorm's ``num_batches_tracked`` (and any integer
buffer) counts something each client advances by its own number of batches;
fedavg refuses integer arrays that differ, so a federated run over unequal
shards would abort in round 1. In a meshkit state an integer buffer is
therefore carried as a float64 count, the aggregators average it like any
float (fedavg: the example-weighted mean of the clients' counts, i.e. the
global count plus the mean batches a client saw), and it is rounded to the
nearest integer, in its own dtype, when loaded back into a module. The state
records which keys these are, and their torch dtype, in the JSON leaf
``INT_BUFFERS`` (identical on every node, so every aggregator passes it
through). Bool buffers stay bool: they are masks, identical everywhere.

A state whose keys differ from the module's is a :class:`MeshError` naming
the missing and the unexpected keys; nothing here loads with
``strict=False``, which would hide a real mismatch.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable, Mapping

import numpy as np
import torch

from meshkit.errors import MeshError
from meshkit.state import BFLOAT16, INT_BUFFERS

__all__ = ["INT_BUFFERS", "to_numpy", "from_numpy", "state_from_tensors",
           "tensors_from_state", "check_keys", "module_state", "load_module_state"]


_INT_DTYPES = {dtype: str(dtype).removeprefix("torch.") for dtype in (
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)}
_BY_NAME = {name: dtype for dtype, name in _INT_DTYPES.items()}


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's values as a numpy array sharing its memory (a copy only off the CPU)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16)
    return t.numpy()


def from_numpy(array: Any) -> torch.Tensor:
    """A CPU tensor sharing ``array``'s memory (bfloat16 viewed through int16)."""
    a = np.asarray(array)
    if a.dtype == BFLOAT16:
        return _shared(a.view(np.int16)).view(torch.bfloat16)
    return _shared(a)


def _shared(a: np.ndarray) -> torch.Tensor:
    if any(s < 0 for s in a.strides) or not a.dtype.isnative:
        a = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("="))
    if a.flags.writeable:
        return torch.from_numpy(a)
    # States decoded from the wire are read-only views of the frame; torch
    # warns that it cannot mark the tensor read-only. Nothing here writes into
    # a tensor made from a state (loading copies, or only reads), so say nothing.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def state_from_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """A meshkit state from a state_dict: arrays share memory; integer buffers become counts."""
    state: dict[str, Any] = {}
    ints: dict[str, str] = {}
    for key, tensor in tensors.items():
        if tensor.dtype in _INT_DTYPES:
            ints[key] = _INT_DTYPES[tensor.dtype]
            state[key] = to_numpy(tensor).astype(np.float64)  # a count: a few bytes
        else:
            state[key] = to_numpy(tensor)
    if ints:
        state[INT_BUFFERS] = ints
    return state


#: The numpy dtypes a tensor can hold (``torch.from_numpy``'s list, plus bfloat16).
_TENSOR_KINDS = frozenset("biufc")
_UNSUPPORTED = frozenset({np.dtype(np.longdouble), np.dtype(np.clongdouble)})


def tensors_from_state(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """CPU tensors from a meshkit state; floats share memory, counts are rounded back.

    A value no tensor can hold (a string, datetime or void array, a long
    double) and a malformed ``INT_BUFFERS`` entry are a :class:`MeshError`
    naming the key, never a ``TypeError`` from torch.
    """
    ints = _int_buffers(state)
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key == INT_BUFFERS:
            continue
        array = np.asarray(value)
        if array.dtype != BFLOAT16 and (array.dtype.kind not in _TENSOR_KINDS
                                        or array.dtype in _UNSUPPORTED):
            raise MeshError(f"state key {key!r} holds a {array.dtype} array, which no torch "
                            f"tensor can hold (tensors are bool, integer, float or complex)")
        if key in ints:
            counts = np.asarray(array, np.float64)
            if not np.isfinite(counts).all():
                raise MeshError(f"state key {key!r}: integer buffer holds NaN or inf")
            out[key] = torch.from_numpy(np.asarray(np.rint(counts))).to(ints[key])
        else:
            out[key] = from_numpy(array)
    return out


def _int_buffers(state: Mapping[str, Any]) -> dict[str, torch.dtype]:
    """The state's ``INT_BUFFERS`` entry checked: {key in the state: integer dtype}."""
    entry = state.get(INT_BUFFERS)
    if entry is None:
        return {}
    if not isinstance(entry, Mapping):
        raise MeshError(f"state key {INT_BUFFERS!r} is a {type(entry).__name__}, not a JSON "
                        f"object of state key -> integer dtype name")
    ints: dict[str, torch.dtype] = {}
    for key, name in entry.items():
        dtype = _BY_NAME.get(name) if isinstance(name, str) else None
        if dtype is None:
            raise MeshError(f"state key {INT_BUFFERS!r}: integer buffer {key!r} has dtype "
                            f"{str(name)[:40]!r}, not one of {', '.join(_BY_NAME)}")
        if key not in state or key == INT_BUFFERS:
            raise MeshError(f"state key {INT_BUFFERS!r} lists {str(key)[:80]!r}, which the "
                            f"state does not hold")
        ints[key] = dtype
    return ints


def check_keys(state: Iterable[str], expected: Iterable[str], where: str) -> None:
    """Refuse a state whose keys are not the module's, naming what is missing and extra."""
    have = {k for k in state if k != INT_BUFFERS}
    want = set(expected)
    if have == want:
        return
    missing, extra = sorted(want - have), sorted(have - want)
    parts = []
    if missing:
        parts.append(f"missing {', '.join(map(repr, missing))}")
    if extra:
        parts.append(f"unexpected {', '.join(map(repr, extra))}")
    raise MeshError(
        f"{where}: the state's keys differ from the model's ({'; '.join(parts)}). A state "
        f"is loaded strictly: build the model the state came from, or convert the state's "
        f"keys first")


def module_state(module: torch.nn.Module) -> dict[str, Any]:
    """The module's state_dict as a meshkit state (sharing the module's memory on the CPU)."""
    return state_from_tensors(module.state_dict())


def load_module_state(module: torch.nn.Module, state: Mapping[str, Any], *,
                      where: str, assign: bool = False, copy: bool = True) -> None:
    """Load ``state`` into ``module`` strictly, with a clear error for any key or shape.

    With ``assign`` the module takes new tensors (its old ones, which a state
    handed out earlier may share, are left alone); ``copy`` makes those
    tensors the module's own (needed when training will write into them).
    Without ``assign`` the values are copied into the module's tensors.
    """
    current = module.state_dict()
    check_keys(state, current, where)
    tensors = tensors_from_state(state)
    for key, target in current.items():
        if tuple(tensors[key].shape) != tuple(target.shape):
            raise MeshError(
                f"{where}: state key {key!r} has shape {list(tensors[key].shape)}, the "
                f"model's is {list(target.shape)}")
    if not assign:
        with torch.no_grad():
            for key, target in current.items():
                target.copy_(tensors[key])
        return
    device = next((t.device for t in current.values()), torch.device("cpu"))
    placed = {}
    for key, tensor in tensors.items():
        dtype = current[key].dtype
        placed[key] = tensor.to(device=device, dtype=dtype, copy=copy)
    module.load_state_dict(placed, strict=True, assign=True)
