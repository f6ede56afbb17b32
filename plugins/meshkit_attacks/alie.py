"""``alie``: "a little is enough" (Baruch, Baruch, Goldberg, *A Little Is Enough:
Circumventing Defenses For Distributed Learning*, NeurIPS 2019).

Every attacker sends, coordinate by coordinate, ``mu - z * sigma``: the
honest updates' mean minus ``z`` of their (population) standard
deviations -- close enough to the honest cloud to pass median, trimmed
mean and Krum, far enough, every round, to steer them. With ``z = 0`` (the
default) ``z`` is the paper's ``z_max`` for the round's ``n`` contributors
and ``f`` attackers::

    s = floor(n / 2 + 1) - f;   z_max = Phi^-1((n - s) / n)

(``Phi`` the standard normal CDF; n = 20, f = 4 gives s = 7 and z_max =
Phi^-1(0.65) = 0.385). Omniscient: it reads the round's honest updates,
which only a simulation's coordinator holds (a node refuses ``--attack alie``).
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any, Mapping

import numpy as np

from meshkit import AggregationError

__all__ = ["ALittleIsEnough", "z_max"]


def z_max(n: int, f: int) -> float:
    """Baruch et al.'s z for ``n`` contributors of which ``f`` attack."""
    s = math.floor(n / 2 + 1) - f
    p = (n - s) / n
    if not 0 < p < 1:
        raise AggregationError(f"attack alie: z_max is undefined for n = {n}, f = {f} "
                               f"((n - s) / n = {p:g}); give z explicitly")
    return NormalDist().inv_cdf(p)


class ALittleIsEnough:
    """``mu - z * sigma`` of the honest updates, coordinate by coordinate."""

    omniscient = True

    def __init__(self, z: float = 0.0) -> None:
        self.z = z

    def tamper(self, update: Mapping[str, np.ndarray], round: Any) -> dict[str, np.ndarray]:
        honest = list(round.honest)
        if not honest:
            raise AggregationError("attack alie: the round has no honest contribution to "
                                   "hide among; give it fewer attackers than clients per round")
        z = self.z or z_max(round.contributors, round.attackers)
        poisoned = {}
        for key in update:
            stack = np.stack([h[key] for h in honest])
            poisoned[key] = stack.mean(axis=0) - z * stack.std(axis=0)
        return poisoned
