"""``label-flip``: the attacker trains honestly on flipped labels, ``y -> C - 1 - y``
(the label-flipping data poisoning of Biggio et al., ICML 2012; Fang et al., USENIX
Security 2020).

``C`` is the task's number of classes, read from the training labels
(their largest value plus one), so every attacker flips the same way. The
update is not touched afterwards: what the attacker sends is an honest fit
of poisoned data.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

__all__ = ["LabelFlip"]


class LabelFlip:
    """Flip integer class labels: ``y -> classes - 1 - y``."""

    poisons_data = True

    def poison(self, x: Any, y: Any, *, classes: int) -> tuple[Any, Any]:
        labels = np.asarray(y)
        return x, (classes - 1 - labels).astype(labels.dtype)

    def tamper(self, update: Mapping[str, np.ndarray], round: Any) -> Mapping[str, np.ndarray]:
        return update
