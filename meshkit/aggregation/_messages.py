"""How a refusal names what it found: values, long numbers and lists of contributors.

Every :class:`~meshkit.AggregationError` of this package words a value it
refuses, a weight too long to print, or the contributors involved through
these helpers, so the messages read the same whichever rule refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from meshkit.state import dtype_name, is_array


def describe(value: Any) -> str:
    """What a contributor sent, in a few words ("a float32 array of shape (2,)")."""
    if is_array(value):
        return f"a {dtype_name(value.dtype)} array of shape {tuple(np.shape(value))}"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the bool {value!r}"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"


def short(value: Any) -> str:
    """repr of a weight, shortened: an int beyond float range has hundreds of digits."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def listing(labels: list[str]) -> str:
    """"a", "a and b", "a, b and c"."""
    if len(labels) <= 1:
        return "".join(labels)
    return f"{', '.join(labels[:-1])} and {labels[-1]}"
