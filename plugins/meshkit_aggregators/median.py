"""``median``: the coordinate-wise median (Yin et al., *Byzantine-Robust Distributed
Learning: Towards Optimal Statistical Rates*, ICML 2018).

Convention: each coordinate is the median of the contributors' values;
with an even count, the mean of the two middle values (``numpy.median``,
as Flower's ``FedMedian``). Each contributor counts once, whatever its
weight, as in Flower: a weight is realized work the client reports itself,
and a robust rule that trusted it would give an attacker the round for
claiming many examples. Translation-equivariant, so it needs no reference.
"""

from __future__ import annotations

import numpy as np

from meshkit_aggregators.robust import RobustRule

__all__ = ["Median"]


class Median(RobustRule):
    """Coordinate-wise median; even count: mean of the two middle values."""

    name = "median"

    def combine(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return np.median(x, axis=0)
