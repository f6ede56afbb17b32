"""A round's contributions as one float64 matrix: what every robust rule computes on.

Rule: a robust rule (median, Krum, ...) sees the round as a matrix ``X``,
one row per contributor and one column per float coordinate (every
floating array leaf, flattened in key order), in float64, and returns one
row; :meth:`Flat.state` turns that row back into a state, each array in its
input dtype. What is not a float array is not the rule's business: integer
arrays (counters) and JSON leaves must agree or are combined exactly as the
strict mean (:class:`meshkit.aggregation.MeanFold`) combines them, weighted
by realized work.

Strictness is the kernel's (:func:`meshkit.aggregation.check_contributions`:
missing keys, shapes, dtypes, weights), plus: a non-finite coordinate is an
:class:`meshkit.AggregationError` naming the contributor and key (a robust
rule would otherwise sort a NaN somewhere and return a plausible number).

With a ``reference`` (the round's global state) the rows are *updates*,
``contribution - reference``, and the result is ``reference + row``.

Memory: ``X`` is contributors x model in float64 — a robust rule needs
every contribution at once (docs/aggregators.md, "Memory").
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from meshkit import AggregationError
from meshkit.aggregation import (MeanFold, aggregate_by_folding, check_contributions,
                                 default_source)
from meshkit.state import is_array, is_float_dtype

__all__ = ["Flat", "require", "count_once"]

State = Mapping[str, Any]


def require(name: str, n: int, needed: int, why: str) -> None:
    """Refuse a round of ``n`` contributors when the rule needs ``needed``."""
    if n < needed:
        raise AggregationError(
            f"{name}: {n} contributor(s) this round, but it needs at least {needed} ({why}); "
            f"sample more clients per round, or lower f")


def count_once(weights: np.ndarray) -> np.ndarray:
    """Equal weights for a rule that counts each contributor once (see docs/aggregators.md)."""
    return np.ones_like(weights)


_ZEROS = np.zeros(1 << 16)


def _finite(values: np.ndarray) -> bool:
    """Whether every value is finite: a dot product with zeros is 0, or NaN for NaN/inf."""
    for lo in range(0, values.size, _ZEROS.size):
        part = values[lo:lo + _ZEROS.size]
        if np.vdot(part, _ZEROS[:part.size]) != 0:
            return False
    return True


class Flat:
    """The float coordinates of a round, stacked (see the module docstring)."""

    def __init__(self, states: Sequence[State], weights: Sequence[float] | None, *, name: str,
                 reference: State | None = None) -> None:
        states = list(states)
        self.name = name
        self.weights = np.asarray(check_contributions(states, weights, name=name),
                                  dtype=np.float64)
        first = states[0]
        self.keys = [k for k, v in first.items() if is_array(v) and is_float_dtype(v.dtype)]
        self.shapes = {k: np.shape(first[k]) for k in self.keys}
        self.dtypes = {k: first[k].dtype for k in self.keys}
        self.states = states
        sizes = [int(np.prod(self.shapes[k], dtype=np.int64)) for k in self.keys]
        self.offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(int)
        width = int(self.offsets[-1])
        self.reference = None if reference is None else self._row(
            reference, "the reference", np.empty(width, dtype=np.float64))
        self.matrix = np.empty((len(states), width), dtype=np.float64)
        for i, state in enumerate(states):
            # Each row is written once, in place: no temporary per row or key.
            row = self._row(state, default_source(i), self.matrix[i])
            if self.reference is not None:
                row -= self.reference

    def __len__(self) -> int:
        return len(self.states)

    def _row(self, state: State, label: str, row: np.ndarray) -> np.ndarray:
        """``state``'s float coordinates written into ``row`` (float64), checked finite."""
        for key, start, stop in zip(self.keys, self.offsets[:-1], self.offsets[1:]):
            value = state.get(key) if isinstance(state, Mapping) else None
            if value is None or np.shape(value) != self.shapes[key]:
                found = "missing" if value is None else f"shape {np.shape(value)}"
                raise AggregationError(
                    f"{self.name}: {label}: key {key!r} is {found}, the contributions have "
                    f"shape {self.shapes[key]}")
            flat = row[start:stop]
            np.copyto(flat, np.asarray(value).reshape(-1), casting="unsafe")
            if not _finite(flat):
                raise AggregationError(
                    f"{self.name}: {label} has non-finite values in {key!r}; a robust rule "
                    f"would sort them somewhere and return a plausible number, so the "
                    f"contribution is refused")
        return row

    def state(self, row: np.ndarray) -> dict[str, Any]:
        """``row`` (plus the reference) as a state; other leaves as the strict mean gives them."""
        if self.reference is not None:
            row = row + self.reference
        others = [{k: v for k, v in s.items() if k not in self.shapes} for s in self.states]
        rest: dict[str, Any] = {}
        if others[0]:
            rest = aggregate_by_folding(MeanFold(name=self.name), others, list(self.weights),
                                        name=self.name)
        result: dict[str, Any] = {}
        for key, value in self.states[0].items():
            if key in self.shapes:
                i = self.keys.index(key)
                chunk = row[self.offsets[i]:self.offsets[i + 1]]
                result[key] = np.asarray(chunk.reshape(self.shapes[key])).astype(
                    self.dtypes[key])
            else:
                result[key] = rest[key]
        return result
