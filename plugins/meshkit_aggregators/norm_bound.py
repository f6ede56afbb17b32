"""``norm-bound``: clip every update's norm, then the strict mean (Sun et al., *Can You
Really Backdoor Federated Learning?*, 2019).

Each contribution's update ``d_i = contribution_i - reference`` (the
round's global model; without one, the contributions are the updates) is
clipped to L2 norm ``max_norm`` over the whole update
(:func:`meshkit.aggregation.clip_update`), and the clipped contributions
``reference + clip(d_i)`` are folded by the strict mean weighted by
realized work (``fedavg``'s :class:`meshkit.aggregation.MeanFold`). It
streams: one contribution is clipped and folded at a time, so the
coordinator holds O(model), like ``fedavg``. ``max_norm`` is required:
there is no norm that suits every model.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from meshkit import AggregationError
from meshkit.aggregation import AggregatorTraits, MeanFold, aggregate_by_folding, clip_update, default_source
from meshkit.state import State, is_array, is_float_dtype

__all__ = ["NormBound", "NormBoundFold"]


def _difference(state: State, reference: State | None, source: str, name: str) -> dict[str, Any]:
    if reference is None:
        return dict(state)
    update: dict[str, Any] = {}
    for key, value in state.items():
        if is_array(value) and is_float_dtype(value.dtype):
            base = reference.get(key)
            if base is None or np.shape(base) != np.shape(value):
                raise AggregationError(f"{name}: {source}: key {key!r} has no counterpart of "
                                       f"shape {np.shape(value)} in the round's reference")
            update[key] = np.asarray(value, dtype=np.float64) - np.asarray(base, np.float64)
    return update


class NormBoundFold:
    """Clip each arriving update to ``max_norm`` and fold it into the strict mean."""

    def __init__(self, max_norm: float, reference: State | None, name: str) -> None:
        self.max_norm, self.reference, self.name = max_norm, reference, name
        self.mean = MeanFold(weighted=True, name=name)

    def add(self, state: State, weight: float = 1.0, *, source: str | None = None) -> None:
        label = source or default_source(self.mean.count)
        update = _difference(state, self.reference, label, self.name)
        clipped, norm = clip_update(update, self.max_norm)
        if not math.isfinite(norm):
            raise AggregationError(f"{self.name}: {label} has a non-finite update norm; "
                                   f"the contribution is refused")
        bounded = dict(state)
        for key, value in clipped.items():
            if key in update and is_array(state.get(key)) and is_float_dtype(state[key].dtype):
                base = 0.0 if self.reference is None else np.asarray(self.reference[key],
                                                                     np.float64)
                bounded[key] = (base + value).astype(state[key].dtype)
        self.mean.add(bounded, weight, source=label)

    def result(self) -> dict[str, Any]:
        return self.mean.result()


class NormBound:
    """Norm-clipped updates, then fedavg's mean (see the module docstring)."""

    name = "norm-bound"
    #: Not linear: each update is clipped by its own norm before the mean, so the
    #: result is no weighted mean of the contributions (a sum cannot feed it).
    traits = AggregatorTraits(uses_reference=True)

    def __init__(self, max_norm: float) -> None:
        if not max_norm > 0 or not math.isfinite(max_norm):
            raise ValueError(f"max_norm must be a finite number > 0, got {max_norm!r}")
        self.max_norm = max_norm

    def begin(self, *, reference: State | None = None) -> NormBoundFold:
        return NormBoundFold(self.max_norm, reference, self.name)

    def aggregate(self, states: Sequence[State], weights: Sequence[float] | None = None,
                  *, reference: State | None = None) -> dict[str, Any]:
        return aggregate_by_folding(self.begin(reference=reference), states, weights,
                                    name=self.name)

    def __repr__(self) -> str:
        return f"NormBound(max_norm={self.max_norm!r})"
