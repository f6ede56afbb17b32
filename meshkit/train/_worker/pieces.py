"""A kept result handed over one piece at a time (``take`` with ``piece``, issue 39).

The worker cuts its kept result exactly as the coordinator plans it
(:func:`meshkit.aggregation.piece_plan` of the result's float arrays, in key
order): piece ``i`` is those arrays' flat slices, piece 0 also carries the
other entries whole. The result is forgotten when its last piece is taken;
until then any piece may be asked for again.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from meshkit.aggregation import float_layout, piece_plan
from meshkit.errors import MeshError

__all__ = ["take_piece"]


def take_piece(kept: dict[int, dict[str, Any]], key: int, piece: int,
               piece_bytes: int) -> dict[str, Any]:
    """Piece ``piece`` of the result kept under ``key``, cut in ``piece_bytes``."""
    result = kept[key]
    plan = piece_plan(float_layout(result), piece_bytes)
    if not 0 <= piece < len(plan):
        raise MeshError(f"result {key} has {len(plan)} pieces of {piece_bytes} bytes; there "
                        f"is no piece {piece}")
    out: dict[str, Any] = {name: np.ascontiguousarray(result[name]).reshape(-1)[lo:hi]
                           for name, lo, hi in plan[piece]}
    if piece == 0:
        floats = {name for name, _, _ in float_layout(result)}
        out.update({name: value for name, value in result.items() if name not in floats})
    if piece == len(plan) - 1:
        del kept[key]
    return out
