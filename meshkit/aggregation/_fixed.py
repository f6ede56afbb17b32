"""Exact, order-free weighted sums: :class:`FixedPointSum` and its :class:`FixedPartial`.

STAND-IN (branch i22-torchrun) for the module H3 writes on i22-engine with
the same names; the merge takes theirs. Only what the collective round
needs: float arrays, weights that are whole numbers of examples.

Each contribution's float array times its weight is rounded to a multiple
of 2^-F (``fraction_bits`` F) into an int64 accumulator, so a sum does not
depend on the order or the split of its terms: partials merged in any order
give the same bits. Overflow is refused before it can happen.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs
import numpy as np

from meshkit.errors import AggregationError
from meshkit.state import is_array, is_float_dtype

__all__ = ["FixedPointSum", "FixedPartial", "DEFAULT_FRACTION_BITS"]

#: 2^-32: far below float32's rounding of any value near 1.
DEFAULT_FRACTION_BITS = 32

#: Largest |term| an int64 accumulator takes so that 2^10 of them cannot overflow.
_LIMIT = float(2 ** 52)


@attrs.frozen
class FixedPartial:
    """A fold's exact partial sums: int64 arrays, the mass and the count."""

    sums: Mapping[str, np.ndarray]
    dtypes: Mapping[str, str]
    shapes: Mapping[str, tuple[int, ...]]
    mass: int
    count: int
    fraction_bits: int = DEFAULT_FRACTION_BITS


class FixedPointSum:
    """Streaming exact weighted sum (see the module docstring)."""

    def __init__(self, *, fraction_bits: int = DEFAULT_FRACTION_BITS) -> None:
        if not 0 <= fraction_bits <= 40:
            raise ValueError(f"fraction_bits must be 0..40, got {fraction_bits}")
        self.fraction_bits = fraction_bits
        self._scale = float(2 ** fraction_bits)
        self._sums: dict[str, np.ndarray] | None = None
        self._dtypes: dict[str, str] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self.mass = 0
        self.count = 0

    def add(self, state: Mapping[str, Any], weight: float = 1.0, *,
            source: str | None = None) -> None:
        label = source or f"contributor #{self.count}"
        if weight < 0 or weight != int(weight):
            raise AggregationError(f"fixed-point sum: {label} has weight {weight}; it takes "
                                   f"whole numbers of examples")
        w = int(weight)
        if self._sums is None:
            self._sums = {}
            for key, value in state.items():
                if not (is_array(value) and is_float_dtype(np.asarray(value).dtype)):
                    raise AggregationError(f"fixed-point sum: {label}'s {key!r} is not a float "
                                           f"array")
                a = np.asarray(value)
                self._sums[key] = np.zeros(a.size, np.int64)
                self._dtypes[key] = str(a.dtype)
                self._shapes[key] = a.shape
        for key, acc in self._sums.items():
            if key not in state:
                raise AggregationError(f"fixed-point sum: {label} lacks {key!r}")
            a = np.asarray(state[key], dtype=np.float64).reshape(-1)
            if a.size != acc.size:
                raise AggregationError(f"fixed-point sum: {label}'s {key!r} has {a.size} "
                                       f"elements, expected {acc.size}")
            term = np.rint(a * (w * self._scale))
            if not np.isfinite(term).all() or (np.abs(term) > _LIMIT).any():
                raise AggregationError(f"fixed-point sum: {label}'s {key!r} times its weight "
                                       f"leaves the range it supports (|x*w| < 2^"
                                       f"{52 - self.fraction_bits})")
            acc += term.astype(np.int64)
        self.mass += w
        self.count += 1

    def partial(self) -> FixedPartial:
        if self._sums is None:
            raise AggregationError("fixed-point sum: no contributions")
        return FixedPartial(dict(self._sums), dict(self._dtypes), dict(self._shapes),
                            self.mass, self.count, self.fraction_bits)

    def merge(self, partial: FixedPartial) -> None:
        if partial.fraction_bits != self.fraction_bits:
            raise AggregationError("fixed-point sum: partials of different fraction_bits")
        if self._sums is None:
            self._sums = {k: np.array(v, np.int64) for k, v in partial.sums.items()}
            self._dtypes, self._shapes = dict(partial.dtypes), dict(partial.shapes)
        else:
            for key, acc in self._sums.items():
                acc += partial.sums[key]
        self.mass += partial.mass
        self.count += partial.count

    def result(self) -> dict[str, Any]:
        if self._sums is None or self.mass <= 0:
            raise AggregationError("fixed-point sum: nothing to divide (mass 0)")
        out: dict[str, Any] = {}
        for key, acc in self._sums.items():
            mean = acc.astype(np.float64) / (self._scale * self.mass)
            out[key] = mean.astype(np.dtype(self._dtypes[key])).reshape(self._shapes[key])
        return out
