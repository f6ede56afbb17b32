"""Update compression: the contract a compressor implements, the payload it travels in, and
what it composes with.

A ``[compression]`` table selects a compressor (kind ``compression``, hook
``meshkit_compression()``); the built-ins (``quantize``, ``top-k``, each with
``rotate``) are the ``meshkit_compression`` plugin package. What lives where:

* ``_contract.py``: :class:`Compressor` and :class:`CompressionTraits`;
* ``_payload.py``: the payload layout, :func:`encode_update` (the worker)
  and :func:`decode_contribution` (the coordinator, checked before decoding);
* ``_plan.py``: :class:`CompressionPlan` and :func:`check_compression`,
  every composition decided by traits;
* ``_fold.py``: :class:`CompressedSum`, the exact sum a linear fold keeps of
  compressed contributions, decoded a chunk at a time (no float copy of one);
* ``_grid.py``: :class:`CodeSum`, clients' codes on the configuration's shared grid
  (``[compression] clip_range``) summed as integers -- a worker's one sum, exact.

docs/compression.md is the user's guide.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshkit._lazy import on_first_use

if TYPE_CHECKING:
    from meshkit.compression._contract import (CompressionTraits, Compressor, FieldCompressor,
                                               compression_traits)
    from meshkit.compression._payload import (RESIDUAL, SEP, check_model_keys, compressed_keys,
                                              decode_contribution, decode_field_sum, encode_update,
                                              field_codes, is_residual, key_seed, residual_name)
    from meshkit.compression._fold import DECODE_STEP, CompressedSum, decoded_chunks
    from meshkit.compression._grid import CodeSum, GridTotal, grid_codes
    from meshkit.compression._plan import CompressionPlan, check_compression, upload_estimate

#: Where each public name lives, imported on first use (an uncompressed round never
#: needs the grids and folds; every process a run starts paid for all of it:
#: docs/benchmarks.md, "ci2"). The imports above are the same names for the type
#: checker (tests/kernel/test_lazy_imports.py keeps the two in step).
_WHERE: dict[str, str] = {
    "CompressionTraits": "meshkit.compression._contract",
    "Compressor": "meshkit.compression._contract",
    "FieldCompressor": "meshkit.compression._contract",
    "compression_traits": "meshkit.compression._contract",
    "RESIDUAL": "meshkit.compression._payload",
    "SEP": "meshkit.compression._payload",
    "check_model_keys": "meshkit.compression._payload",
    "compressed_keys": "meshkit.compression._payload",
    "decode_contribution": "meshkit.compression._payload",
    "decode_field_sum": "meshkit.compression._payload",
    "encode_update": "meshkit.compression._payload",
    "field_codes": "meshkit.compression._payload",
    "is_residual": "meshkit.compression._payload",
    "key_seed": "meshkit.compression._payload",
    "residual_name": "meshkit.compression._payload",
    "DECODE_STEP": "meshkit.compression._fold",
    "CompressedSum": "meshkit.compression._fold",
    "decoded_chunks": "meshkit.compression._fold",
    "CodeSum": "meshkit.compression._grid",
    "GridTotal": "meshkit.compression._grid",
    "grid_codes": "meshkit.compression._grid",
    "CompressionPlan": "meshkit.compression._plan",
    "check_compression": "meshkit.compression._plan",
    "upload_estimate": "meshkit.compression._plan",
}

__all__ = ["CompressionTraits", "Compressor", "FieldCompressor", "compression_traits",
           "RESIDUAL", "SEP", "check_model_keys", "compressed_keys", "field_codes",
           "decode_field_sum", "decode_contribution", "encode_update", "is_residual",
           "key_seed", "residual_name", "CompressionPlan", "check_compression",
           "upload_estimate", "CompressedSum", "decoded_chunks", "DECODE_STEP", "CodeSum",
           "GridTotal", "grid_codes"]


if not TYPE_CHECKING:  # the type checker reads the imports above instead
    __getattr__, __dir__ = on_first_use(__name__, _WHERE, globals())
