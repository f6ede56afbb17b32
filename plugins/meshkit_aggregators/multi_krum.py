"""``multi-krum``: the mean of the ``m`` contributions with the lowest Krum scores
(El Mhamdi et al., *The Hidden Vulnerability of Distributed Learning in Byzantium*,
ICML 2018; Flower's ``aggregate_krum`` with ``to_keep = m``).

Scores as ``krum`` (squared distances to the ``n - f - 2`` nearest others,
from one Gram matrix, selecting as the direct float64 distances do; equal
scores by content; needs ``n >= 2f + 3``). The ``m`` best are averaged
weighted by realized work, as Flower's MultiKrum averages them
(``aggregate``, weighted by examples). ``m = 0`` (the default) means
``n - f``, the paper's choice; an ``m`` larger than the round's
contributors is an AggregationError. ``f = 0`` with ``m = 0`` keeps every
contribution -- fedavg -- so ``[aggregator]`` refuses it (MultiKrumOptions).
"""

from __future__ import annotations

import numpy as np

from meshkit import AggregationError

from meshkit_aggregators._distances import Distances
from meshkit_aggregators._flat import require
from meshkit_aggregators.krum import check_f, neighbours
from meshkit_aggregators.robust import RobustRule

__all__ = ["MultiKrum"]


class MultiKrum(RobustRule):
    """Weighted mean of the ``m`` best-scored contributions."""

    name = "multi-krum"

    def __init__(self, f: int = 0, m: int = 0) -> None:
        self.f = check_f(f)
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"m (contributions averaged) must be an integer >= 0 "
                             f"(0: n - f), got {m!r}")
        self.m = m

    def combine(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        n = len(x)
        require(self.name, n, 2 * self.f + 3, f"n >= 2f + 3 with f = {self.f}")
        m = self.m or n - self.f
        if m > n:
            raise AggregationError(f"{self.name}: m = {m} contributions to average, but only "
                                   f"{n} this round; lower m (0: n - f)")
        best = sorted(Distances(x).best(np.arange(n), neighbours(n, self.f), m))
        weights = np.zeros(n)
        weights[best] = w[best]
        if not weights.sum() > 0:
            raise AggregationError(f"{self.name}: the {m} contributions Krum kept did no work "
                                   f"(their weights sum to zero)")
        # Zero weight for the others: one pass over the round, no copy of the kept rows.
        result: np.ndarray = weights @ x / weights.sum()
        return result
