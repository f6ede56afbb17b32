"""``same-value``: every coordinate of the attacker's update is ``value`` (the
same-value attack of Li et al., *RSA: Byzantine-Robust Stochastic Aggregation
Methods*, AAAI 2019).

``value`` defaults to 100.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

__all__ = ["SameValue"]


class SameValue:
    """An update with every coordinate ``value``."""

    def __init__(self, value: float = 100.0) -> None:
        self.value = value

    def tamper(self, update: Mapping[str, np.ndarray], round: Any) -> dict[str, np.ndarray]:
        return {k: np.full(np.shape(v), self.value, dtype=np.float64) for k, v in update.items()}
