"""What an activation is: a flat float32 vector of real numbers.

Every value a stage function or a board hands back passes through
:func:`as_activation` before it travels on, so something that is not
numbers is an error naming who returned it, never a NaN passed on as a
result.
"""

from __future__ import annotations

import reprlib
from typing import Any

import numpy as np

from meshkit.errors import MeshError

__all__ = ["as_activation"]


def as_activation(value: Any, where: str, error: type[MeshError] = MeshError) -> np.ndarray:
    """``value`` as a flat float32 activation; anything but real numbers is ``error``.

    ``numpy.asarray(None, float32)`` is ``[nan]``: a function or board that
    forgot to return would otherwise pass a NaN on as if it were a result.
    ``where`` names who returned ``value`` in the message.
    """
    try:
        array = None if value is None else np.asarray(value)
    except (TypeError, ValueError):  # ragged sequences and the like
        array = None
    numeric = array is not None and (
        array.dtype.kind in "biuf"
        or array.dtype.type.__module__.startswith("ml_dtypes"))  # bfloat16 and friends
    if not numeric:
        found = reprlib.repr(value) if array is None or array.dtype.kind == "O" \
            else f"{reprlib.repr(value)} (dtype {array.dtype})"
        raise error(f"{where} returned {found}, expected numbers (a 1-D float32 activation)")
    assert array is not None
    return np.asarray(array, dtype=np.float32).reshape(-1)
