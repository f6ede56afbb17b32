"""Coordinate-wise robust aggregation: the numerics behind ``median`` and ``trimmed-mean``.

Both rules are *weighted* in the sense meshkit's reduce service needs: a
contribution of weight ``k`` counts exactly like ``k`` copies of it, so
realized-work weights (examples seen) mean the same thing they mean for
``fedavg``. Unlike a mean, neither can be folded as contributions arrive, so
no ``begin()`` is offered: meshkit's buffering fold keeps the round's
contributions and calls :meth:`CoordinateWise.aggregate` at the end.

Strictness follows meshkit's aggregation contract: every refusal is a
:class:`meshkit.AggregationError` naming the key and the contributors.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from meshkit import AggregationError
from meshkit.aggregation import check_weight, default_source
from meshkit.state import dtype_name, is_array, is_float_dtype

__all__ = ["CoordinateWise", "weighted_median", "weighted_trimmed_mean"]

#: Coordinates reduced per step: bounds the float64 scratch to
#: contributors x CHUNK x 8 bytes whatever the model size.
CHUNK = 1 << 16

Reducer = Callable[[np.ndarray, np.ndarray], np.ndarray]


def _sorted_with_weights(values: np.ndarray,
                         weights: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Values sorted per coordinate, their weights, and the cumulative weights."""
    order = np.argsort(values, axis=0, kind="stable")
    v = np.take_along_axis(values, order, axis=0)
    w = weights[order]
    return v, w, np.cumsum(w, axis=0)


def weighted_median(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Per column of ``values`` (contributors on axis 0): the weighted median.

    The value where the cumulative weight crosses half the total; when it
    lands exactly on half, the mean of the two values either side, which is
    ``numpy.median`` for equal weights.
    """
    v, _, cum = _sorted_with_weights(values, weights)
    half = cum[-1] / 2.0
    lower = np.argmax(cum >= half, axis=0)
    upper = np.argmax(cum > half, axis=0)
    cols = np.arange(values.shape[1])
    return (v[lower, cols] + v[upper, cols]) / 2.0


def weighted_trimmed_mean(values: np.ndarray, weights: np.ndarray, trim: float) -> np.ndarray:
    """Per column: the mean of the weight mass left after cutting ``trim`` of it each end.

    Trimming is by mass, fractionally: with 10 equal contributions and
    ``trim = 0.15`` one and a half contributions are cut from each end. That
    is what makes weight ``k`` equal to ``k`` copies exactly.
    """
    v, w, cum = _sorted_with_weights(values, weights)
    total = cum[-1]
    lo = trim * total
    hi = total - lo
    kept = np.minimum(cum, hi) - np.maximum(cum - w, lo)
    np.clip(kept, 0.0, None, out=kept)
    return np.einsum("ij,ij->j", kept, v) / kept.sum(axis=0)


class CoordinateWise:
    """An aggregator applying ``reducer`` coordinate by coordinate.

    ``reducer(values, weights)`` gets a float64 matrix (contributors x
    coordinates) and the weight vector and returns one float64 row.
    """

    def __init__(self, name: str, reducer: Reducer) -> None:
        self.name = name
        self._reducer = reducer

    def __repr__(self) -> str:
        return f"<meshkit-robust aggregator {self.name!r}>"

    def aggregate(self, states: Sequence[Mapping[str, Any]],
                  weights: Sequence[float] | None = None) -> dict[str, Any]:
        states = list(states)
        if not states:
            raise AggregationError(f"{self.name}: no contributions to aggregate; a round "
                                   f"needs at least one contributor")
        sources = [default_source(i) for i in range(len(states))]
        w = self._weights(weights, sources)
        for state, source in zip(states, sources):
            if not isinstance(state, Mapping):
                raise AggregationError(f"{self.name}: {source} sent {type(state).__name__}, "
                                       f"expected a state (a mapping of name -> value)")
        self._check_keys(states, sources)
        return {key: self._combine(key, [s[key] for s in states], w, sources)
                for key in states[0]}

    # -- checks ------------------------------------------------------------

    def _weights(self, weights: Sequence[float] | None, sources: list[str]) -> np.ndarray:
        if weights is None:
            return np.ones(len(sources))
        weights = list(weights)
        if len(weights) != len(sources):
            raise AggregationError(
                f"{self.name}: {len(sources)} states but {len(weights)} weights; give one "
                f"weight per contribution, or none")
        w = np.array([check_weight(x, s, name=self.name) for x, s in zip(weights, sources)])
        if not w.sum() > 0:
            raise AggregationError(
                f"{self.name}: the weights sum to zero; at least one contributor must have "
                f"done some work (weight > 0)")
        return w

    def _check_keys(self, states: list[Mapping[str, Any]], sources: list[str]) -> None:
        # A key one contributor lacks is refused, never aggregated over the
        # contributors that have it: that would silently re-weight the rest.
        first = set(states[0])
        for state, source in zip(states[1:], sources[1:]):
            for key in sorted(first - set(state), key=str):
                raise AggregationError(
                    f"{self.name}: key {key!r} is missing from {source}, but {sources[0]} "
                    f"sent it; every contributor must send the same keys")
            for key in sorted(set(state) - first, key=str):
                raise AggregationError(
                    f"{self.name}: {source} sent key {key!r}, which {sources[0]} did not; "
                    f"every contributor must send the same keys")

    # -- combining ---------------------------------------------------------

    def _combine(self, path: str, values: list[Any], w: np.ndarray,
                 sources: list[str]) -> Any:
        first = values[0]
        if is_array(first):
            return self._combine_arrays(path, values, w, sources)
        if isinstance(first, bool) or first is None or isinstance(first, str):
            for value, source in zip(values[1:], sources[1:]):
                if type(value) is not type(first) or value != first:
                    raise AggregationError(
                        f"{self.name}: key {path!r}: {source} sent {value!r} where "
                        f"{sources[0]} sent {first!r}; only numbers are combined, other "
                        f"values must be identical everywhere")
            return first
        if isinstance(first, (int, float)):
            return self._combine_numbers(path, values, w, sources)
        if isinstance(first, list):
            for value, source in zip(values[1:], sources[1:]):
                if not isinstance(value, list) or len(value) != len(first):
                    raise AggregationError(
                        f"{self.name}: key {path!r}: {source} sent {value!r} where "
                        f"{sources[0]} sent a list of {len(first)}; lists combine position "
                        f"by position")
            return [self._combine(f"{path}[{i}]", [v[i] for v in values], w, sources)
                    for i in range(len(first))]
        if isinstance(first, dict):
            for value, source in zip(values[1:], sources[1:]):
                if not isinstance(value, dict) or set(value) != set(first):
                    raise AggregationError(
                        f"{self.name}: key {path!r}: {source} sent {value!r} where "
                        f"{sources[0]} sent an object with keys {sorted(first)}; objects "
                        f"combine key by key")
            return {k: self._combine(f"{path}.{k}", [v[k] for v in values], w, sources)
                    for k in first}
        raise AggregationError(
            f"{self.name}: key {path!r}: {sources[0]} sent a {type(first).__name__}; a state "
            f"value must be a numpy array or a JSON value")

    def _combine_numbers(self, path: str, values: list[Any], w: np.ndarray,
                         sources: list[str]) -> Any:
        for value, source in zip(values, sources):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise AggregationError(
                    f"{self.name}: key {path!r}: {source} sent {value!r} where {sources[0]} "
                    f"sent the number {values[0]!r}")
            if not math.isfinite(value):
                raise AggregationError(
                    f"{self.name}: key {path!r}: {source} sent {value!r}; non-finite values "
                    f"are refused (a diverged contributor must not be hidden)")
        if all(type(v) is type(values[0]) and v == values[0] for v in values):
            return values[0]  # identical numbers pass through, an int stays an int
        column = np.asarray(values, dtype=np.float64).reshape(-1, 1)
        return float(self._reducer(column, w)[0])

    def _combine_arrays(self, path: str, values: list[Any], w: np.ndarray,
                        sources: list[str]) -> np.ndarray:
        first = np.asarray(values[0])
        for value, source in zip(values[1:], sources[1:]):
            if not is_array(value):
                raise AggregationError(
                    f"{self.name}: key {path!r}: {source} sent {type(value).__name__} where "
                    f"{sources[0]} sent a {dtype_name(first.dtype)} array")
            value = np.asarray(value)
            if value.shape != first.shape:
                raise AggregationError(
                    f"{self.name}: key {path!r}: {source} sent shape {value.shape} where "
                    f"{sources[0]} sent {first.shape}; every contributor must hold the "
                    f"same model")
            if value.dtype != first.dtype:
                raise AggregationError(
                    f"{self.name}: key {path!r}: {source} sent dtype "
                    f"{dtype_name(value.dtype)} where {sources[0]} sent "
                    f"{dtype_name(first.dtype)}; cast contributions to one dtype first")
        if not is_float_dtype(first.dtype):
            for value, source in zip(values[1:], sources[1:]):
                if not np.array_equal(value, first):
                    raise AggregationError(
                        f"{self.name}: key {path!r}: {source} and {sources[0]} sent "
                        f"different {dtype_name(first.dtype)} arrays; integer and bool "
                        f"arrays are not combined, they must be identical everywhere")
            return first.copy()
        if len(values) == 1:
            return first.copy()  # the identity, bit for bit
        flat = [np.asarray(v).reshape(-1) for v in values]
        out = np.empty(first.size, dtype=first.dtype)
        block = np.empty((len(flat), min(CHUNK, first.size)), dtype=np.float64)
        for start in range(0, first.size, CHUNK):
            stop = min(start + CHUNK, first.size)
            rows = block[:, : stop - start]
            for i, v in enumerate(flat):
                rows[i] = v[start:stop]  # widened to float64 on copy
            finite = np.isfinite(rows)
            if not finite.all():
                bad = sources[int(np.argwhere(~finite)[0, 0])]
                # Sorting would push NaN to one end where trimming hides it.
                raise AggregationError(
                    f"{self.name}: key {path!r}: {bad} sent NaN or inf; non-finite values "
                    f"are refused (a diverged contributor must not be hidden). Find why "
                    f"it diverged, or drop it from the round")
            out[start:stop] = self._reducer(rows, w)
        return out.reshape(first.shape)
