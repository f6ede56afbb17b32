"""What differential privacy releases of a state, and a client's clipping of its own update.

Only floating-point arrays are updates (:func:`float_keys`): integer arrays
(counters such as ``num_batches_tracked``) and JSON leaves take the global
model's value, so nothing is released about them. With ``[privacy] clip =
"client"`` a worker clips its update before it replies
(:func:`clip_contribution`), so the coordinator only ever sees the
reference plus a clipped update.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from meshkit.aggregation import clip_update

__all__ = ["float_keys", "clip_contribution"]


def float_keys(state: Mapping[str, Any]) -> list[str]:
    """The keys of ``state`` whose values are floating-point arrays (what DP releases)."""
    return sorted(k for k, v in state.items()
                  if isinstance(v, np.ndarray) and np.issubdtype(v.dtype, np.floating))


def clip_contribution(reference: Mapping[str, Any], state: Mapping[str, Any],
                      clip_norm: float) -> tuple[dict[str, Any], float]:
    """``state`` with its update (``state`` − ``reference``) clipped to ``clip_norm``, and
    the update's norm before clipping (module docstring)."""
    keys = [k for k in float_keys(reference) if k in state]
    update = {k: np.asarray(state[k], np.float64) - reference[k].astype(np.float64)
              for k in keys}
    clipped, norm = clip_update(update, clip_norm)
    out = dict(state)
    for key in keys:
        out[key] = (reference[key].astype(np.float64) + clipped[key]).astype(
            np.asarray(state[key]).dtype)
    return out, norm
