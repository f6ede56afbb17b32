"""``scale``: the attacker sends ``factor * d`` (model-replacement boosting, Bagdasaryan
et al., *How To Backdoor Federated Learning*, AISTATS 2020; Bhagoji et al., ICML 2019).

``factor`` defaults to 10. A mean weighs a boosted update ``factor`` times
as much as an honest one; a rule that clips or bounds norms does not.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

__all__ = ["Scale"]


class Scale:
    """``factor`` times the attacker's own update."""

    def __init__(self, factor: float = 10.0) -> None:
        self.factor = factor

    def tamper(self, update: Mapping[str, np.ndarray], round: Any) -> dict[str, np.ndarray]:
        return {k: self.factor * v for k, v in update.items()}
