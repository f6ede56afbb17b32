"""``clipped-mean``: each update (contribution - reference) clipped to ``max_norm``, then averaged
with the contributors' weights; and eleven ways to get it wrong."""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from meshkit.aggregation import AggregatorTraits, BufferingFold, MeanFold, check_contributions
from meshkit.state import BFLOAT16


def _is_float(value: Any) -> bool:
    return isinstance(value, np.ndarray) and (value.dtype.kind == "f" or value.dtype == BFLOAT16)


class ClippedMean:
    """The correct rule."""

    traits = AggregatorTraits(uses_reference=True)
    # The kernel's BufferingFold (meshkit.aggregation.uses_reference) still
    # reads this older spelling on this branch; the kit reads both.
    uses_reference = True
    name = "clipped-mean"

    def __init__(self, max_norm: float = 1.0) -> None:
        self.max_norm = max_norm

    def begin(self, *, reference: Any = None) -> BufferingFold:
        return BufferingFold(self, reference=reference)

    def is_float(self, value: Any) -> bool:
        return _is_float(value)

    def weights_of(self, states: Sequence[Any], weights: Sequence[float] | None) -> list[float]:
        return check_contributions(states, weights, name=self.name)

    def updates(self, state: Any, reference: Any) -> dict[str, np.ndarray]:
        return {k: np.asarray(v, np.float64) - (0.0 if reference is None
                                                else np.asarray(reference[k], np.float64))
                for k, v in state.items() if self.is_float(v)}

    def factor(self, norm: float, index: int, norms: list[float]) -> float:
        return 1.0 if norm <= self.max_norm else self.max_norm / norm

    def clipped(self, state: Any, reference: Any, factor: float) -> dict[str, Any]:
        out = dict(state)
        for key, update in self.updates(state, reference).items():
            base = 0.0 if reference is None else np.asarray(reference[key], np.float64)
            out[key] = (base + factor * update).astype(state[key].dtype)
        return out

    def fold(self) -> MeanFold:
        return MeanFold(weighted=True, name=self.name)

    def aggregate(self, states: Sequence[Any], weights: Sequence[float] | None = None, *,
                  reference: Any = None) -> dict[str, Any]:
        states = list(states)
        ws = self.weights_of(states, weights)
        norms = [math.sqrt(sum(float(np.sum(u * u)) for u in self.updates(s, reference).values()))
                 for s in states]
        fold = self.fold()
        for i, (state, weight) in enumerate(zip(states, ws)):
            fold.add(self.clipped(state, reference, self.factor(norms[i], i, norms)), weight,
                     source=f"contributor #{i}")
        return fold.result()


class IgnoresWeights(ClippedMean):
    def weights_of(self, states, weights):
        return [1.0] * len(check_contributions(states, weights, name=self.name))


class ClipsInPlace(ClippedMean):
    def clipped(self, state, reference, factor):
        for key in self.updates(state, reference):
            if factor < 1.0:
                base = 0.0 if reference is None else reference[key]
                state[key] -= base
                state[key] *= state[key].dtype.type(factor)
                state[key] += base
        return dict(state)


class BfloatIsNotFloat(ClippedMean):
    def is_float(self, value):
        return isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.floating)


class IgnoresReference(ClippedMean):
    def updates(self, state, reference):
        return super().updates(state, None)

    def clipped(self, state, reference, factor):
        return super().clipped(state, None, factor)


class Float64Out(ClippedMean):
    def aggregate(self, states, weights=None, *, reference=None):
        result = super().aggregate(states, weights, reference=reference)
        return {k: v.astype(np.float64) if self.is_float(v) else v for k, v in result.items()}


class NormalisesWeightsInPlace(ClippedMean):
    def weights_of(self, states, weights):
        if weights is not None:
            total = sum(weights)
            for i in range(len(weights)):
                weights[i] /= total  # the list the caller passed
        return check_contributions(states, weights, name=self.name)


class ClipsToTheFirstNorm(ClippedMean):
    """Adaptive clipping at the first arrival's norm: depends on arrival order."""

    def factor(self, norm, index, norms):
        limit = norms[0]  # "the first update is a fair scale": it depends on who is first
        return 1.0 if norm <= limit else limit / norm


class BuildsOnTheReference(ClippedMean):
    """Adds the clipped updates onto the reference's own arrays."""

    def aggregate(self, states, weights=None, *, reference=None):
        result = super().aggregate(states, weights, reference=reference)
        if reference is None:
            return result
        for key, value in result.items():
            if self.is_float(value):
                target = reference[key]
                target[...] = value
                result[key] = target
        return result


class DropsNaN(ClippedMean):
    """Skips a contributor holding NaN instead of refusing it."""

    def aggregate(self, states, weights=None, *, reference=None):
        states = list(states)
        keep = [i for i, s in enumerate(states)
                if all(np.isfinite(np.asarray(v, np.float64)).all()
                       for v in s.values() if self.is_float(v))]
        return super().aggregate([states[i] for i in keep],
                                 None if weights is None else [weights[i] for i in keep],
                                 reference=reference)


class TightensEachRound(ClippedMean):
    """Halves its threshold after every round, declaring no state."""

    def aggregate(self, states, weights=None, *, reference=None):
        result = super().aggregate(states, weights, reference=reference)
        self.max_norm /= 2
        return result


class FoldIgnoresWeights(ClippedMean):
    """The streaming form (what a round uses) drops the weights."""

    def begin(self, *, reference=None):
        outer = self

        class _Fold(BufferingFold):
            def add(self, state, weight=1.0, *, source=None):
                super().add(state, 1.0, source=source)

        return _Fold(outer, reference=reference)


MISTAKES = {
    "ignored weights": IgnoresWeights,
    "in-place clipping of inputs": ClipsInPlace,
    "bf16 by np.issubdtype(dtype, np.floating)": BfloatIsNotFloat,
    "ignored reference": IgnoresReference,
    "wrong dtype out": Float64Out,
    "mutating weights": NormalisesWeightsInPlace,
    "order-dependent result": ClipsToTheFirstNorm,
    "result written into the reference": BuildsOnTheReference,
    "NaN contributor silently dropped": DropsNaN,
    "undeclared state across rounds": TightensEachRound,
    "streaming fold ignores weights": FoldIgnoresWeights,
}
