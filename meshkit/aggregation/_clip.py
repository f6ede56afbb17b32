"""Norms and norm clipping of an update: the one place an update's L2 norm is decided.

An *update* is a state (``name -> array | JSON value``), usually a
contribution minus the round's global model. Its norm is the float64 L2
norm over every numeric array leaf taken together (as if they were one
flattened vector); JSON leaves are configuration, not parameters, and are
ignored. Clipping scales every numeric array leaf by the same factor
``min(1, clip_norm / norm)``, so the direction is kept and the clipped
norm is at most ``clip_norm``; each leaf keeps its input dtype.

Shared by the robust aggregators (``norm-bound``, ``centered-clipping``)
and the differential-privacy clipping, so both clip by the same rule.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from meshkit.state import is_array, is_float_dtype

__all__ = ["global_norm", "clip_update", "squared_norm"]


def _numeric(value: Any) -> bool:
    """A numeric array leaf: any float dtype (bfloat16 included) or integer; not bool."""
    return is_array(value) and (is_float_dtype(value.dtype)
                                or np.issubdtype(value.dtype, np.integer))


def global_norm(update: Mapping[str, Any]) -> float:
    """The float64 L2 norm over every numeric array leaf of ``update`` (JSON leaves ignored)."""
    leaves = [value for value in update.values() if _numeric(value) and value.size]
    with np.errstate(over="ignore"):
        total = sum((squared_norm(value) for value in leaves), 0.0)
    if math.isfinite(total) and total < 1e290:
        return math.sqrt(total)
    # The squares overflowed (an update of 1e155 is finite; its norm is too):
    # again, scaled by the largest magnitude, as hypot does.
    scale = max(float(np.max(np.abs(np.asarray(value).astype(np.float64, copy=False))))
                for value in leaves)
    if not math.isfinite(scale):
        return math.inf
    scaled = sum(squared_norm(np.asarray(value).astype(np.float64, copy=False) / scale)
                 for value in leaves)
    return scale * math.sqrt(scaled)


def squared_norm(array: np.ndarray) -> float:
    """Σ x² of one array, in float64.

    einsum's own loop, not ``np.dot``: BLAS threads that spin on a loaded
    machine made the dot product 20-700x slower than the loop here.
    """
    flat = np.asarray(array).astype(np.float64, copy=False).ravel()
    return float(np.einsum("i,i->", flat, flat))


def clip_update(update: Mapping[str, Any], clip_norm: float) -> tuple[dict[str, Any], float]:
    """``update`` scaled by ``min(1, clip_norm / norm)``, and its pre-clip norm.

    Every numeric array leaf is scaled by the same factor, in float64, and
    cast back to its input dtype; JSON leaves pass unchanged. A zero norm
    (or one within ``clip_norm`` already) leaves the update unchanged.
    """
    if not clip_norm >= 0 or not math.isfinite(clip_norm):
        raise ValueError(f"clip_norm must be a finite number >= 0, got {clip_norm!r}")
    norm = global_norm(update)
    if norm == 0.0 or norm <= clip_norm:
        return dict(update), norm
    factor = clip_norm / norm
    clipped: dict[str, Any] = {}
    for key, value in update.items():
        if _numeric(value):
            clipped[key] = (np.asarray(value, dtype=np.float64) * factor).astype(value.dtype)
        else:
            clipped[key] = value
    return clipped, norm
