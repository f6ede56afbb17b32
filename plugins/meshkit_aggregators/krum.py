"""``krum``: the contribution closest to its neighbours (Blanchard et al., *Machine
Learning with Adversaries: Byzantine Tolerant Gradient Descent*, NeurIPS 2017).

Convention (the paper's, and Flower's ``aggregate_krum``): with ``n``
contributors of which at most ``f`` are Byzantine, each contributor's score
is the sum of the *squared* Euclidean distances to its ``n - f - 2``
nearest other contributors; Krum returns the contribution with the lowest
score. The paper's guarantee needs ``n >= 2f + 3``: fewer is an
AggregationError saying how many. ``f`` defaults to 0, as Flower's
``num_malicious_clients``. Selection ignores weights (as Flower).
Distances between contributions equal distances between updates, so no
reference is needed.

Cost: the distances come from one Gram matrix per round
(:class:`meshkit_aggregators._distances.Distances`), and the selection is
the one the direct float64 distances ``sum((a - b) ** 2)`` give: where the
product's error bound cannot rank two scores, the rows involved are given
their direct distances. Ties (equal direct scores, e.g. two mutual nearest
neighbours when one neighbour is counted) go to the lexicographically
smaller contribution -- never to arrival position, so the result does not
depend on the order contributions arrive in (Flower breaks them by
position; on tie-free rounds the two agree).
"""

from __future__ import annotations

import numpy as np

from meshkit_aggregators._distances import Distances
from meshkit_aggregators._flat import require
from meshkit_aggregators.robust import RobustRule

__all__ = ["Krum", "neighbours", "check_f"]


def neighbours(n: int, f: int) -> int:
    """How many nearest others a Krum score sums: ``n - f - 2``, at least one."""
    return max(1, n - f - 2)


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
        n = len(x)
        require(self.name, n, 2 * self.f + 3, f"n >= 2f + 3 with f = {self.f}")
        best = Distances(x).best(np.arange(n), neighbours(n, self.f), 1)[0]
        result: np.ndarray = x[best]
        return result
