"""``trimmed-mean``: the coordinate-wise trimmed mean (Yin et al., ICML 2018).

Convention (Flower's ``FedTrimmedAvg``, scipy's ``trim_mean``): with ``n``
contributors, ``k = floor(beta * n)`` values are cut from each end of every
coordinate *after sorting it*, and the ``n - 2k`` left are averaged.
``beta`` defaults to 0.2 (Flower's default) and must be in [0, 0.5). Each
contributor counts once, whatever its weight (as Flower; docs/aggregators.md).
"""

from __future__ import annotations

import numpy as np

from meshkit_aggregators.robust import RobustRule

__all__ = ["TrimmedMean"]


class TrimmedMean(RobustRule):
    """Mean of each coordinate's values after cutting ``floor(beta * n)`` from each end."""

    name = "trimmed-mean"

    def __init__(self, beta: float = 0.2) -> None:
        if not 0.0 <= beta < 0.5:
            raise ValueError(f"beta must be in [0, 0.5), got {beta!r}")
        self.beta = beta

    def combine(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        n = len(x)
        cut = int(self.beta * n)
        return np.sort(x, axis=0)[cut:n - cut].mean(axis=0)
