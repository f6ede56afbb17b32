"""The safetensors file format, written and read with numpy alone.

safetensors (Hugging Face) is the format the transformers/diffusers/timm
ecosystem loads without pickle. Its layout is small enough to write here
instead of depending on the ``safetensors`` package, whose numpy API has no
bfloat16 (numpy lacks it; meshkit carries it as ml_dtypes' ``bfloat16``):

* 8 bytes: ``N``, the header's length, an unsigned little-endian 64-bit integer;
* ``N`` bytes: a UTF-8 JSON object, ``{name: {"dtype": "F32", "shape": [..],
  "data_offsets": [begin, end]}}`` plus an optional ``"__metadata__"``
  object of string to string; padded with spaces to a multiple of 8 so the
  data that follows is aligned;
* the data: every tensor's bytes, little-endian, C order, back to back, at
  its offsets (relative to the end of the header), with no gap and no overlap.

How a meshkit state maps onto it (:func:`state_tensors`):

* every array keeps its dtype: ``F64 F32 F16 BF16 I64 I32 I16 I8 U64 U32 U16
  U8 BOOL``; 0-d arrays have shape ``[]``;
* integer buffers a torch run carries as float64 counts (the
  :data:`meshkit.state.INT_BUFFERS` leaf, see :mod:`meshkit.torch`) come back
  rounded in their own integer dtype, as ``meshkit export --format torch``
  gives them, so the file is what ``model.state_dict()`` would hold;
* every other JSON leaf (a ``{"mu": 1.5}`` of a Python filter) goes into
  ``__metadata__`` as its JSON text under its own key (safetensors has no
  tensor for it); ``meshkit.round`` there says which round the model is from.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from meshkit._atomic import atomic_file
from meshkit.checkpoint import checkpoint_path, load_checkpoint
from meshkit.errors import ConfigError, StateError
from meshkit.state import BFLOAT16, INT_BUFFERS, is_array

__all__ = ["DTYPES", "MAX_HEADER", "export", "read_safetensors", "state_tensors",
           "write_safetensors"]

#: numpy dtype -> safetensors dtype name (every dtype a meshkit state array may have).
DTYPES: dict[np.dtype, str] = {
    np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
    BFLOAT16: "BF16",
    np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int16): "I16",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint64): "U64", np.dtype(np.uint32): "U32", np.dtype(np.uint16): "U16",
    np.dtype(np.uint8): "U8",
    np.dtype(np.bool_): "BOOL",
}
_BY_NAME = {name: dtype for dtype, name in DTYPES.items()}

#: The largest header read back (the Rust reference implementation's own limit).
MAX_HEADER = 100_000_000

#: The ``__metadata__`` key saying which round the exported model is from.
ROUND_KEY = "meshkit.round"


def state_tensors(state: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """A meshkit state as (tensors, metadata): arrays by name, JSON leaves as JSON text."""
    ints = dict(state.get(INT_BUFFERS) or {})
    tensors: dict[str, np.ndarray] = {}
    metadata: dict[str, str] = {}
    for key, value in state.items():
        if key == INT_BUFFERS:
            continue
        if key in ints:
            try:
                dtype = np.dtype(str(ints[key]))
            except TypeError:
                dtype = None
            if dtype is None or dtype.kind not in "iu":
                raise StateError(f"state key {key!r}: integer buffer dtype {ints[key]!r} is "
                                 f"not an integer dtype")
            tensors[key] = np.rint(np.asarray(value, np.float64)).astype(dtype)
        elif is_array(value):
            array = np.asarray(value)
            if array.dtype not in DTYPES:
                raise StateError(f"state key {key!r}: dtype {array.dtype} has no safetensors "
                                 f"name; supported: {', '.join(sorted(_BY_NAME))}")
            tensors[key] = array
        else:
            metadata[key] = json.dumps(value, allow_nan=False, sort_keys=True)
    return tensors, metadata


def _header(tensors: Mapping[str, np.ndarray],
            metadata: Mapping[str, str]) -> tuple[bytes, list[np.ndarray]]:
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    blobs = []
    offset = 0
    for name in sorted(tensors):
        if name == "__metadata__":
            raise StateError("state key '__metadata__' is reserved by the safetensors format; "
                             "rename it")
        array = tensors[name]
        # Little-endian, C order: the format's only layout.
        data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        header[name] = {"dtype": DTYPES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
        blobs.append(data)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return text, blobs


def write_safetensors(file: str | os.PathLike[str], tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> Path:
    """Write ``tensors`` (and string ``metadata``) to ``file``, atomically."""
    overlap = sorted(set(metadata or {}) & set(tensors))
    if overlap:
        raise StateError(f"keys {overlap} are both tensors and metadata")
    header, blobs = _header(tensors, metadata or {})
    target = Path(file)
    with atomic_file(target) as fh:
        fh.write(struct.pack("<Q", len(header)))
        fh.write(header)
        for blob in blobs:
            fh.write(blob.reshape(-1).view(np.uint8).data)
    return target


def read_safetensors(file: str | os.PathLike[str]
                     ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Read a safetensors file back as (tensors, metadata); bfloat16 as ml_dtypes'.

    Every offset and length is checked against the file before anything is
    allocated: a damaged or hostile file is a :class:`StateError`.
    """
    raw = Path(file).read_bytes()
    if len(raw) < 8:
        raise StateError(f"{str(file)!r}: {len(raw)} bytes, too short for a safetensors file")
    (length,) = struct.unpack("<Q", raw[:8])
    if length > min(MAX_HEADER, len(raw) - 8):
        raise StateError(f"{str(file)!r}: header length {length} exceeds the file "
                         f"({len(raw)} bytes) or {MAX_HEADER}")
    try:
        header = json.loads(raw[8:8 + length].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # RecursionError: a header of nested brackets; json has no depth limit of its own.
        raise StateError(f"{str(file)!r}: the header is not UTF-8 JSON: "
                         f"{type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(header, dict):
        raise StateError(f"{str(file)!r}: the header is not a JSON object")
    data = memoryview(raw)[8 + length:]
    metadata = _metadata(file, header.pop("__metadata__", None))
    entries = sorted(_entry(file, name, e) for name, e in header.items())
    tensors: dict[str, np.ndarray] = {}
    end = 0
    for begin, stop, name, dtype, shape in entries:
        # numpy refuses a shape whose nonzero dimensions multiply past int64,
        # even when another dimension is 0 (no bytes at all).
        if begin != end or not begin <= stop <= len(data) or \
                math.prod(shape) * dtype.itemsize != stop - begin or \
                math.prod(max(n, 1) for n in shape) >= 2 ** 62:
            raise StateError(f"{str(file)!r}: tensor {name!r} does not fit the file (dtype, "
                             f"shape or offsets {begin}..{stop} disagree)")
        tensors[name] = np.frombuffer(data[begin:stop], dtype=dtype.newbyteorder("<")
                                      ).astype(dtype).reshape(shape)
        end = stop
    if end != len(data):
        raise StateError(f"{str(file)!r}: {len(data) - end} bytes after the last tensor")
    return tensors, metadata


def _metadata(file: str | os.PathLike[str], value: Any) -> dict[str, str]:
    """The ``__metadata__`` object: string to string, or nothing."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise StateError(f"{str(file)!r}: __metadata__ must be a JSON object of strings, got "
                         f"{json.dumps(value)[:80]}")
    return dict(value)


def _count(value: Any) -> int:
    """A JSON whole number >= 0 (not a bool, not a float), else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{json.dumps(value)[:40]} is not a whole number >= 0")
    return value


def _entry(file: str | os.PathLike[str], name: str,
           entry: Any) -> tuple[int, int, str, np.dtype, tuple[int, ...]]:
    """One tensor's (begin, end, name, dtype, shape), every field checked for its type.

    Python ints, so no product or offset can wrap as numpy's int64 would.
    """
    try:
        if not isinstance(entry, dict):
            raise ValueError(f"the entry is {json.dumps(entry)[:40]}, not an object")
        dtype = entry["dtype"]
        if not isinstance(dtype, str) or dtype not in _BY_NAME:
            raise ValueError(f"dtype {json.dumps(dtype)[:40]} is not one of "
                             f"{', '.join(sorted(_BY_NAME))}")
        shape, offsets = entry["shape"], entry["data_offsets"]
        if not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2:
            raise ValueError("shape must be a list and data_offsets a list of two numbers")
        begin, stop = _count(offsets[0]), _count(offsets[1])
        dims = tuple(_count(n) for n in shape)
    except (KeyError, ValueError) as exc:
        raise StateError(f"{str(file)!r}: tensor {name!r}: {type(exc).__name__}: {exc}; each "
                         f"entry needs dtype, shape and data_offsets") from None
    return begin, stop, name, _BY_NAME[dtype], dims


def export(source: str | os.PathLike[str], file: str | os.PathLike[str]) -> Path:
    """Write the run's global model (a run directory or checkpoint) to ``file`` as safetensors."""
    checkpoint = load_checkpoint(source)
    try:
        tensors, metadata = state_tensors(checkpoint.state)
    except (StateError, ValueError) as exc:
        raise ConfigError(f"{str(checkpoint_path(source))!r}: cannot be written as "
                          f"safetensors: {exc}") from None
    if ROUND_KEY in metadata or ROUND_KEY in tensors:
        raise ConfigError(f"{str(checkpoint_path(source))!r}: state key {ROUND_KEY!r} is "
                          f"reserved in the safetensors metadata; rename it")
    metadata[ROUND_KEY] = str(checkpoint.round)
    return write_safetensors(file, tensors, metadata)

