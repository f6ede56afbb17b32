"""Pairwise squared distances of a round: one Gram matrix, made exact wherever a selection needs it.

Rule: Krum, Multi-Krum and Bulyan select contributions by squared
Euclidean distances, and their selection must be the one the *direct*
float64 distances give (the reference: ``sum((a - b) ** 2)`` for every
pair, :func:`direct`). Computing those directly costs ``n^2 * d``
subtractions; here they come from one Gram matrix per round,
``||a - b||^2 = ||a||^2 + ||b||^2 - 2 a.b``, a float64 matrix product
(BLAS ``syrk``) of the rows centred on one contribution (distances do not
change under a shift, but the cancellation in ``-2 a.b`` shrinks to the
spread of the round instead of its magnitude).

Each Gram distance carries a rigorous bound of its difference from the
reference (the worst-case error of a ``d``-term float64 dot product, of
the centring and of the reference's own summation). A selection compares
intervals; only when intervals overlap (a near-tie) are the rows involved
given their direct distances, so the selection equals the reference's
whatever the rounding, at the cost of one Gram matrix in every round
without near-ties. Exact ties (equal direct scores) go to the
lexicographically smaller contribution (:func:`content_key`), never to
arrival position.

Magnitude: a row whose squared norm overflows (or passes 1e300) is kept
out of the product's trust: its distances get the lower bound the
triangle inequality gives (``(||a|| - ||b||)^2`` from overflow-safe
norms) and are computed directly only if a selection needs them, where
the reference's own overflow (``inf``) is the value, so one contribution
at 1e300 neither poisons the others' distances nor becomes a neighbour.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import numpy as np

__all__ = ["Distances", "direct", "content_key", "distances_to"]

_U = 2.0 ** -53
_MAX = float(np.finfo(np.float64).max)
# A squared norm above this is not trusted to the product: d of them
# would overflow the sum.
_HUGE_SQUARE = 1e300
#: Columns centred and multiplied at a time (100 rows x 64Ki float64 = 52 MB).
BLOCK = 1 << 16
#: The most float64 elements the centred block holds (64 MB): more rows, fewer columns.
_SCRATCH = 1 << 23


def direct(a: np.ndarray, b: np.ndarray) -> float:
    """The reference squared distance between two rows: ``sum((a - b) ** 2)`` in float64."""
    with np.errstate(over="ignore"):
        return float(np.sum((a - b) ** 2))


def safe_norm(row: np.ndarray) -> float:
    """``||row||`` without overflow or underflow (scaled by its largest magnitude)."""
    scale = float(np.max(np.abs(row))) if row.size else 0.0
    if scale == 0.0:
        return 0.0
    scaled = row / scale
    return scale * math.sqrt(float(np.einsum("i,i->", scaled, scaled)))


# Sums of squares outside this range are recomputed scaled.
_SAFE_LOW, _SAFE_HIGH = 1e-290, 1e290


def distances_to(x: np.ndarray, z: np.ndarray) -> np.ndarray:
    """``||x_i - z||`` for every row, without overflow or underflow."""
    diff = x - z
    with np.errstate(over="ignore", under="ignore"):
        squares = np.einsum("ij,ij->i", diff, diff)
    distance = np.sqrt(squares)
    for i in np.flatnonzero(~((squares >= _SAFE_LOW) & (squares <= _SAFE_HIGH))):
        scale = float(np.max(np.abs(diff[i])))
        if scale == 0.0 or not math.isfinite(scale):
            distance[i] = scale
            continue
        scaled = diff[i] / scale
        distance[i] = scale * math.sqrt(float(np.einsum("i,i->", scaled, scaled)))
    return distance


def content_key(x: np.ndarray) -> Callable[[int], Any]:
    """A sort key ordering row indices of ``x`` by the rows' content (lexicographic)."""

    def compare(i: int, j: int) -> int:
        if i == j:
            return 0
        differ = np.flatnonzero(x[i] != x[j])
        if not differ.size:
            return 0
        k = int(differ[0])
        return -1 if x[i, k] < x[j, k] else 1

    return functools.cmp_to_key(compare)


class Distances:
    """Interval squared distances between the rows of ``x``, exact on demand.

    ``low[i, j] <= direct(x[i], x[j]) <= high[i, j]`` for every pair;
    :meth:`exact_row` replaces a row's intervals by the direct values.
    ``x`` (contributors x coordinates, float64, finite) is read, never
    written.
    """

    def __init__(self, x: np.ndarray, *, block: int = BLOCK) -> None:
        self.x = x
        n, d = x.shape
        self.n = n
        block = min(block, max(1024, _SCRATCH // max(n, 1)))
        gram = np.zeros((n, n))
        centre = self._centre(x)
        if d:
            scratch = np.empty(n * min(block, d))
            with np.errstate(over="ignore", invalid="ignore"):
                for lo in range(0, d, block):
                    hi = min(lo + block, d)
                    # Contiguous, even for the last, narrower block: BLAS's syrk
                    # takes a strided view ten times slower.
                    part = scratch[:n * (hi - lo)].reshape(n, hi - lo)
                    np.subtract(x[:, lo:hi], centre[lo:hi], out=part)
                    gram += np.dot(part, part.T)  # syrk: the product's symmetric half
        square = np.diag(gram).copy()
        huge = ~np.isfinite(square) | (square > _HUGE_SQUARE)
        with np.errstate(over="ignore", invalid="ignore"):
            norms = np.sqrt(np.where(huge, 0.0, np.maximum(square, 0.0)))
        # Overflow-safe norms of the untrusted rows, from the centred row itself.
        for i in np.flatnonzero(huge):
            norms[i] = safe_norm(x[i] - centre)
        gamma = (d + 2) * _U / (1 - (d + 2) * _U)
        with np.errstate(over="ignore", invalid="ignore"):
            estimate = square[:, None] + square[None, :] - 2.0 * gram
            reach = (norms[:, None] + norms[None, :]) ** 2
            # |Gram distance - exact distance| (product, centring, the two sums)
            # plus the reference's own rounding, plus what underflow can lose.
            slack = (gamma + 8 * _U) * reach
            error = 1.01 * (slack + 2 * (d + 3) * _U * (np.abs(estimate) + slack)) \
                + (d + 4) * 2.0 ** -1070
            low = np.maximum(estimate - error, 0.0)
            high = estimate + error
        untrusted = huge[:, None] | huge[None, :]
        gap = np.abs(norms[:, None] - norms[None, :]) * (1 - 1e-6)
        with np.errstate(over="ignore"):
            low = np.where(untrusted, np.minimum(gap * gap, _MAX), low)
        high = np.where(untrusted, np.inf, high)
        np.fill_diagonal(low, 0.0)
        np.fill_diagonal(high, 0.0)
        self.low, self.high = low, high
        self._exact = np.zeros(n, dtype=bool)
        #: Rows given their direct distances so far (a measure of near-ties).
        self.exact_rows = 0

    @staticmethod
    def _centre(x: np.ndarray) -> np.ndarray:
        """The contribution of median norm: inside the honest spread while most are honest."""
        with np.errstate(over="ignore"):
            squares = np.einsum("ij,ij->i", x, x)
        order = np.argsort(squares, kind="stable")
        centre: np.ndarray = x[int(order[(len(x) - 1) // 2])]
        if not np.isfinite(squares[order[(len(x) - 1) // 2]]):
            centre = np.zeros(x.shape[1])  # most rows are huge: nothing to gain
        return centre

    def exact_row(self, i: int) -> None:
        """Give row (and column) ``i`` its direct distances."""
        if self._exact[i]:
            return
        for j in range(self.n):
            if j != i:
                value = direct(self.x[i], self.x[j])
                self.low[i, j] = self.low[j, i] = value
                self.high[i, j] = self.high[j, i] = value
        self._exact[i] = True
        self.exact_rows += 1

    def scores(self, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Bounds on each of ``rows``' Krum scores within ``rows`` (``k`` nearest others)."""
        low = self.low[np.ix_(rows, rows)]
        high = self.high[np.ix_(rows, rows)]
        np.fill_diagonal(low, np.inf)
        np.fill_diagonal(high, np.inf)
        slack = 1 + 2 * (k + 1) * _U  # the reference sums k values in floating point
        with np.errstate(over="ignore", invalid="ignore"):
            lo = np.sort(low, axis=1)[:, :k].sum(axis=1) / slack
            hi = np.sort(high, axis=1)[:, :k].sum(axis=1) * slack
        return lo, hi

    def exact_scores(self, rows: np.ndarray, which: np.ndarray, k: int) -> np.ndarray:
        """The reference's scores of ``rows[which]`` within ``rows`` (as the reference sums)."""
        out = np.empty(len(which))
        for slot, w in enumerate(which):
            i = int(rows[w])
            self.exact_row(i)
            others = np.sort(np.delete(self.low[i, rows], w))
            with np.errstate(over="ignore"):
                out[slot] = float(others[:k].sum())
        return out

    def best(self, rows: np.ndarray, k: int, m: int) -> list[int]:
        """The ``m`` of ``rows`` with the lowest Krum scores, as the reference ranks them.

        Order: by the direct score, equal scores by content. Intervals
        decide wherever they do not overlap; the rows they cannot rank get
        their direct distances.
        """
        rows = np.asarray(rows)
        lo, hi = self.scores(rows, k)
        count = len(rows)
        # Rows that might rank at or before row i, and rows surely before it.
        maybe_before = (lo[None, :] <= hi[:, None]).sum(axis=1) - 1
        surely_before = (hi[None, :] < lo[:, None]).sum(axis=1)
        inside = maybe_before < m
        outside = surely_before >= m
        unsure = np.flatnonzero(~inside & ~outside)
        chosen = [int(rows[i]) for i in np.flatnonzero(inside)]
        left = m - len(chosen)
        if left > 0 and unsure.size:
            exact = self.exact_scores(rows, unsure, k)
            key = content_key(self.x)
            ranked = sorted(range(len(unsure)),
                            key=lambda s: (exact[s], key(int(rows[unsure[s]]))))
            chosen += [int(rows[unsure[s]]) for s in ranked[:left]]
        assert len(chosen) == min(m, count)
        return chosen
