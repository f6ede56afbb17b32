"""``sign-flip``: the attacker sends its update reversed, ``-factor * d`` (the
reversed-gradient attack; e.g. Damaskinos et al., *Asynchronous Byzantine Machine
Learning*, ICML 2018; Allen-Zhu et al., ICLR 2021).

``factor`` defaults to 1 (the plain flip). With ``f`` of ``n`` clients
flipping, the plain mean moves by ``(n - f - f * factor) / n`` of the honest
update: it keeps descending while ``f * factor < n - f``, and ascends past
it -- so a benchmark that wants the mean broken must choose ``factor``
accordingly, and says so (docs/robustness.md uses 10).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

__all__ = ["SignFlip"]


class SignFlip:
    """``-factor`` times the attacker's own update."""

    def __init__(self, factor: float = 1.0) -> None:
        self.factor = factor

    def tamper(self, update: Mapping[str, np.ndarray], round: Any) -> dict[str, np.ndarray]:
        return {k: -self.factor * v for k, v in update.items()}
