"""What differential privacy releases of a state, and a client's clipping of its own update.

Only floating-point arrays are updates (:func:`float_keys`): integer arrays,
integer buffers carried as float64 counts (``num_batches_tracked``, listed in
the state's ``INT_BUFFERS`` leaf) and JSON leaves take the global model's
value, so nothing is released about them. With ``[privacy] clip =
"client"`` a worker clips its update before it replies
(:func:`clip_contribution`), so the coordinator only ever sees the
reference plus a clipped update.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from meshkit.aggregation import clip_update
from meshkit.state import update_keys

__all__ = ["float_keys", "clip_contribution"]


def float_keys(state: Mapping[str, Any]) -> list[str]:
    """The keys of ``state`` DP releases: its updates (:func:`meshkit.state.update_keys`,
    the floating-point arrays, bfloat16 included, less the float-carried counts)."""
    return update_keys(state)


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
