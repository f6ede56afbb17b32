"""What every built-in robust rule shares: stack the round, combine rows, give a state back.

A rule subclasses :class:`RobustRule` and implements ``combine(x, w)``:
``x`` is the round as a float64 matrix (contributors x coordinates,
:class:`meshkit_aggregators._flat.Flat`), ``w`` the realized-work weights,
and the result is one row. Rules keep no streaming fold: meshkit's
buffering fold holds the round's contributions and calls ``aggregate`` at
the end (O(contributors x model) on the coordinator, docs/aggregators.md).
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import numpy as np

from meshkit.aggregation import AggregatorTraits
from meshkit.state import State

from meshkit_aggregators._flat import Flat

__all__ = ["RobustRule"]


class RobustRule:
    """Base of the robust built-ins (see the module docstring)."""

    name: ClassVar[str] = "robust"
    #: A robust rule reads every contribution on its own (so it is not a sum, and
    #: nothing computed from sums may stand in for it); a rule on updates
    #: (``contribution - reference``) or one carrying state declares so.
    traits: ClassVar[AggregatorTraits] = AggregatorTraits()

    def combine(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def aggregate(self, states: Sequence[State], weights: Sequence[float] | None = None,
                  *, reference: State | None = None) -> dict[str, Any]:
        """The rule applied to ``states`` (``reference``: the round's global state)."""
        flat = Flat(states, weights, name=self.name,
                    reference=reference if self.traits.uses_reference else None)
        return flat.state(self.combine(flat.matrix, flat.weights))

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"
