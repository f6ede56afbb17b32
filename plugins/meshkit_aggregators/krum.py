"""``krum``: the contribution closest to its neighbours (Blanchard et al., *Machine
Learning with Adversaries: Byzantine Tolerant Gradient Descent*, NeurIPS 2017).

Convention (the paper's, and Flower's ``aggregate_krum``): with ``n``
contributors of which at most ``f`` are Byzantine, each contributor's score
is the sum of the *squared* Euclidean distances to its ``n - f - 2``
nearest other contributors; Krum returns the contribution with the lowest
score. Ties (two mutual nearest neighbours have equal scores when one
neighbour is counted) are broken by content -- the lexicographically
smaller contribution -- never by arrival position, so the result does not
depend on the order contributions arrive in (Flower breaks them by
position; on tie-free rounds the two agree). The
paper's guarantee needs ``n >= 2f + 3``: fewer is an AggregationError
saying how many. ``f`` defaults to 0, as Flower's ``num_malicious_clients``.
Selection ignores weights (as Flower). Distances between contributions
equal distances between updates, so no reference is needed.
"""

from __future__ import annotations

import numpy as np

from meshkit_aggregators._flat import require
from meshkit_aggregators.robust import RobustRule

__all__ = ["Krum", "krum_scores", "squared_distances", "by_score"]


def squared_distances(x: np.ndarray) -> np.ndarray:
    """The matrix of squared Euclidean distances between the rows of ``x`` (float64)."""
    d = np.empty((len(x), len(x)), dtype=np.float64)
    for i in range(len(x)):
        diff = x - x[i]
        d[i] = np.einsum("ij,ij->i", diff, diff)
    return d


def krum_scores(x: np.ndarray, f: int) -> np.ndarray:
    """Each row's Krum score: the sum of its ``max(1, n - f - 2)`` smallest distances to others."""
    n = len(x)
    d = squared_distances(x)
    np.fill_diagonal(d, np.inf)  # a contributor is not its own neighbour
    neighbours = max(1, n - f - 2)
    return np.sort(d, axis=1)[:, :neighbours].sum(axis=1)


def by_score(x: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """Row indices by ascending score; equal scores by the rows' content (lexicographic)."""
    content = np.lexsort(x.T[::-1])  # rows in lexicographic order of their coordinates
    rank = np.empty(len(x), dtype=np.int64)
    rank[content] = np.arange(len(x))
    order: np.ndarray = np.lexsort((rank, scores))
    return order


def check_f(f: int) -> int:
    if isinstance(f, bool) or not isinstance(f, int) or f < 0:
        raise ValueError(f"f (the Byzantine contributors tolerated) must be an integer >= 0, "
                         f"got {f!r}")
    return f


class Krum(RobustRule):
    """The one contribution with the lowest Krum score."""

    name = "krum"

    def __init__(self, f: int = 0) -> None:
        self.f = check_f(f)

    def combine(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        require(self.name, len(x), 2 * self.f + 3, f"n >= 2f + 3 with f = {self.f}")
        result: np.ndarray = x[int(by_score(x, krum_scores(x, self.f))[0])]
        return result
