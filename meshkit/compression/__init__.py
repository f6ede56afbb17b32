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

from meshkit.compression._contract import (CompressionTraits, Compressor, FieldCompressor,
                                           compression_traits)
from meshkit.compression._payload import (RESIDUAL, SEP, check_model_keys, compressed_keys,
                                          decode_contribution, decode_field_sum, encode_update,
                                          field_codes, is_residual, key_seed, residual_name)
from meshkit.compression._fold import DECODE_STEP, CompressedSum, decoded_chunks
from meshkit.compression._grid import CodeSum, GridTotal, grid_codes
from meshkit.compression._plan import CompressionPlan, check_compression, upload_estimate

__all__ = ["CompressionTraits", "Compressor", "FieldCompressor", "compression_traits",
           "RESIDUAL", "SEP", "check_model_keys", "compressed_keys", "field_codes",
           "decode_field_sum", "decode_contribution", "encode_update", "is_residual",
           "key_seed", "residual_name", "CompressionPlan", "check_compression",
           "upload_estimate", "CompressedSum", "decoded_chunks", "DECODE_STEP", "CodeSum",
           "GridTotal", "grid_codes"]
