"""Fixed-point quantisation of a clipped update into ``[0, 2**modulus_bits)``, and back.

The rule (one place): with ``c = clip_range`` and ``L = params.levels =
min((2**modulus_bits - 1) // clients, 2**53)``, a coordinate ``x`` becomes

    q = rint((clip(x, -c, c) + c) * L / (2 c))        in {0, ..., L}

(round half to even), so the sum of ``clients`` quantised vectors is below
``2**modulus_bits`` and the modular sum the masks leave is the exact integer
sum. The step is ``2c / L``; each coordinate is off by at most half a step.
A sum ``S`` of ``m`` contributions dequantises to

    S * 2c / L - m c

(the sum of the ``m`` clipped inputs, to within ``m`` half-steps). A
non-finite input is an error, never a quantised value.
"""

from __future__ import annotations

import numpy as np

from meshkit.errors import AggregationError
from meshkit_secagg._masks import vector_dtype
from meshkit_secagg._params import SecAggParams

__all__ = ["quantize", "dequantize"]


def quantize(values: np.ndarray, params: SecAggParams) -> np.ndarray:
    """``values`` (any float array, flattened) as integers in ``[0, params.levels]``.

    Clipped to ``[-clip_range, clip_range]`` first. The result's dtype is
    :func:`vector_dtype` of the modulus (uint32 up to 32 bits, else uint64).
    Raises :class:`~meshkit.AggregationError` for a NaN or infinity.
    """
    # A float64 copy of our own, worked on in place from here on.
    scaled = np.array(values, dtype=np.float64).ravel()
    if not np.isfinite(scaled).all():
        raise AggregationError("a secure-aggregation input holds NaN or infinity; a non-finite "
                               "update cannot be quantised")
    c = params.clip_range
    np.clip(scaled, -c, c, out=scaled)
    scaled += c
    scaled *= params.levels / (2.0 * c)
    np.rint(scaled, out=scaled)
    # rint of a value in [0, L] stays in [0, L]; the clip only guards float round-off.
    np.clip(scaled, 0, params.levels, out=scaled)
    return scaled.astype(vector_dtype(params.modulus_bits))


def dequantize(total: np.ndarray, params: SecAggParams, contributors: int) -> np.ndarray:
    """The float64 sum of ``contributors`` clipped inputs whose quantised sum is ``total``.

    ``total`` is the exact integer sum (what :meth:`ServerRound.finish`
    returns); ``contributors`` how many inputs it adds up (1 to
    ``params.clients``).
    """
    if not 1 <= contributors <= params.clients:
        raise ValueError(f"contributors must be 1 to {params.clients}, got {contributors}")
    c = params.clip_range
    out = np.asarray(total).astype(np.float64)
    out *= 2.0 * c / params.levels
    out -= contributors * c
    return out
