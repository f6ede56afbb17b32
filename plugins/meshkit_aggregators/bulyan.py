"""``bulyan``: Krum selection, then a coordinate-wise trimmed mean around the median
(El Mhamdi et al., *The Hidden Vulnerability of Distributed Learning in Byzantium*,
ICML 2018; Flower's ``aggregate_bulyan`` with Krum as its first rule).

Convention (the paper's and Flower's): with ``n`` contributors and ``f``
Byzantine, ``theta = n - 2f`` contributions are selected one at a time by
Krum, each time over the ones not selected yet (Krum scores over
``max(1, len - f - 2)`` nearest others); then, coordinate by coordinate,
the ``beta = theta - 2f`` selected values closest to the selected values'
median are averaged (ties in either step broken by content, as ``krum``
says, so arrival order never matters). Refuses ``n < 4f + 3`` (the paper's assumption, and
Flower's refusal). Each contributor counts once (as Flower). ``f``
defaults to 0 (Flower's ``num_malicious_clients``), where Bulyan is the
plain mean.
"""

from __future__ import annotations

import numpy as np

from meshkit_aggregators._flat import require
from meshkit_aggregators.krum import by_score, check_f, krum_scores
from meshkit_aggregators.robust import RobustRule

__all__ = ["Bulyan"]


class Bulyan(RobustRule):
    """Krum-select ``n - 2f``, then average the ``n - 4f`` values nearest the median."""

    name = "bulyan"

    def __init__(self, f: int = 0) -> None:
        self.f = check_f(f)

    def combine(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        n, f = len(x), self.f
        require(self.name, n, 4 * f + 3, f"n >= 4f + 3 with f = {f}")
        remaining = list(range(n))
        selected = []
        for _ in range(n - 2 * f):
            scores = krum_scores(x[remaining], f)
            selected.append(remaining.pop(int(by_score(x[remaining], scores)[0])))
        chosen = x[selected]
        median = np.median(chosen, axis=0)
        beta = len(selected) - 2 * f
        # Per coordinate: by distance to the median, equal distances by value.
        nearest = np.lexsort((chosen, np.abs(chosen - median)), axis=0)[:beta]
        result: np.ndarray = np.take_along_axis(chosen, nearest, axis=0).mean(axis=0)
        return result
