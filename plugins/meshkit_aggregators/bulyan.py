"""``bulyan``: Krum selection, then a coordinate-wise trimmed mean around the median
(El Mhamdi et al., *The Hidden Vulnerability of Distributed Learning in Byzantium*,
ICML 2018; Flower's ``aggregate_bulyan`` with Krum as its first rule).

Convention (the paper's and Flower's): with ``n`` contributors and ``f``
Byzantine, ``theta = n - 2f`` contributions are selected one at a time by
Krum, each time over the ones not selected yet (Krum scores over
``max(1, len - f - 2)`` nearest others); then, coordinate by coordinate,
the ``beta = theta - 2f`` selected values closest to the selected values'
median are averaged (ties in either step broken by content, as ``krum``
says, so arrival order never matters). Refuses ``n < 4f + 3`` (the paper's
assumption, and Flower's refusal). Each contributor counts once (as
Flower). ``f = 0`` (Flower's default ``num_malicious_clients``) makes
Bulyan the plain mean, so ``[aggregator]`` refuses it (BulyanOptions).

Cost: every selection step reuses the round's one Gram matrix
(:class:`meshkit_aggregators._distances.Distances`); only the scores are
recomputed over the rows still in play. The coordinate-wise stage runs a
block of columns at a time, so no copy of the selected rows is held.
"""

from __future__ import annotations

import numpy as np

from meshkit_aggregators._distances import Distances
from meshkit_aggregators._flat import require
from meshkit_aggregators.krum import check_f, neighbours
from meshkit_aggregators.robust import RobustRule

__all__ = ["Bulyan", "nearest_to_median_mean"]

#: Columns of the coordinate-wise stage handled at a time.
_COLUMNS = 1 << 12


def nearest_to_median_mean(chosen: np.ndarray, beta: int) -> np.ndarray:
    """Per column, the mean of the ``beta`` values nearest the median (ties: smaller value).

    In a sorted column the ``beta`` values nearest a point are a window
    ``[s, s + beta)``; moving it one step right trades ``v[s]`` for
    ``v[s + beta]``, which pays exactly when ``v[s + beta]`` is nearer the
    median (an equal distance keeps the smaller value), and that test only
    turns from true to false along the column, so ``s`` is the number of
    steps where it holds.
    """
    rows, cols = chosen.shape
    # One contiguous row per column: sorting a transposed view copies every
    # column through a buffer, ten times slower.
    ordered = np.ascontiguousarray(chosen.T)
    ordered.sort(axis=1)
    # numpy.median's value ((a + b) / 2 of the middle pair), without its second partition.
    middle = ordered[:, (rows - 1) // 2] + ordered[:, rows // 2]
    median = (middle / 2)[:, None]
    if beta < rows:
        moves = (median - ordered[:, :rows - beta]) > (ordered[:, beta:] - median)
        start = moves.sum(axis=1)
        position = np.arange(rows)
        window = (position >= start[:, None]) & (position < start[:, None] + beta)
        # Zeros outside the window add nothing: the window's sum, in sorted order.
        result: np.ndarray = np.where(window, ordered, 0.0).sum(axis=1) / beta
        return result
    mean: np.ndarray = ordered.mean(axis=1)
    return mean


class Bulyan(RobustRule):
    """Krum-select ``n - 2f``, then average the ``n - 4f`` values nearest the median."""

    name = "bulyan"

    def __init__(self, f: int = 0) -> None:
        self.f = check_f(f)

    def combine(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        n, f = len(x), self.f
        require(self.name, n, 4 * f + 3, f"n >= 4f + 3 with f = {f}")
        distances = Distances(x)
        remaining = list(range(n))
        selected = []
        for _ in range(n - 2 * f):
            best = distances.best(np.array(remaining), neighbours(len(remaining), f), 1)[0]
            remaining.remove(best)
            selected.append(best)
        selected.sort()
        beta = len(selected) - 2 * f
        result = np.empty(x.shape[1])
        for lo in range(0, x.shape[1], _COLUMNS):
            hi = min(lo + _COLUMNS, x.shape[1])
            result[lo:hi] = nearest_to_median_mean(x[selected, lo:hi], beta)
        return result
