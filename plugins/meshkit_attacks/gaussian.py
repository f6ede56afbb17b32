"""``gaussian``: the attacker's update is replaced by Gaussian noise ``N(0, sigma^2)`` per
coordinate (the Gaussian attack of Blanchard et al., NeurIPS 2017, and of ByzFL).

``sigma`` defaults to 1. The noise is drawn from the attack's RNG, seeded
by (run seed, round, client), so a run is reproducible.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

__all__ = ["Gaussian"]


class Gaussian:
    """Noise of standard deviation ``sigma`` in place of the update."""

    def __init__(self, sigma: float = 1.0) -> None:
        self.sigma = sigma

    def tamper(self, update: Mapping[str, np.ndarray], round: Any) -> dict[str, np.ndarray]:
        rng = round.rng
        return {k: rng.normal(0.0, self.sigma, size=np.shape(v)) for k, v in update.items()}
