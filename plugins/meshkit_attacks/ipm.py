"""``ipm``: the inner-product manipulation (Xie, Koyejo, Gupta, *Fall of Empires: Breaking
Byzantine-tolerant SGD by Inner Product Manipulation*, UAI 2019).

Every attacker sends ``-epsilon * mean(honest updates)``, so the
aggregate's inner product with the true descent direction turns negative.
``epsilon`` defaults to 0.1 (the paper's small-epsilon setting, which
defeats median and Krum); large values (the paper also uses 100) break
the plain mean instead. Omniscient: it reads the round's honest updates,
which only a simulation's coordinator holds (``[attack]``; a node refuses
``--attack ipm``).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from meshkit import AggregationError

__all__ = ["InnerProductManipulation"]


class InnerProductManipulation:
    """``-epsilon`` times the mean of the honest updates."""

    omniscient = True

    def __init__(self, epsilon: float = 0.1) -> None:
        self.epsilon = epsilon

    def tamper(self, update: Mapping[str, np.ndarray], round: Any) -> dict[str, np.ndarray]:
        honest = list(round.honest)
        if not honest:
            raise AggregationError("attack ipm: the round has no honest contribution to "
                                   "invert; give it fewer attackers than clients per round")
        return {k: -self.epsilon * np.mean([h[k] for h in honest], axis=0) for k in update}
