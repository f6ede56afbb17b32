"""The built-in aggregators, thin over :class:`meshkit.aggregation.MeanFold`."""

from __future__ import annotations

from typing import Any, Sequence

from meshkit.aggregation import AggregatorTraits, MeanFold, aggregate_by_folding
from meshkit.state import State


class _Mean:
    name = "mean"
    weighted = True
    #: A weighted mean: exact from sums, so secure aggregation, DP's noised sum,
    #: batched and relayed rounds and spmd may stand in for it.
    traits = AggregatorTraits(linear=True, needs_individual_updates=False)

    def __init__(self, *, allow_nonfinite: bool = False, wide: bool = False,
                 retain: int = 1, threads: int = 2) -> None:
        self.allow_nonfinite = allow_nonfinite
        self.wide = wide
        self.retain = retain
        self.threads = threads

    def _fold(self, retain: int | None) -> MeanFold:
        return MeanFold(weighted=self.weighted, name=self.name,
                        allow_nonfinite=self.allow_nonfinite, wide=self.wide, retain=retain,
                        threads=self.threads)

    def begin(self) -> MeanFold:
        """A streaming fold: O(model) memory whatever the number of contributors."""
        return self._fold(self.retain)

    def aggregate(self, states: Sequence[State],
                  weights: Sequence[float] | None = None) -> dict[str, Any]:
        """The batch form (labels ``contributor #i``).

        The states are all in memory already, so the fold keeps them all and
        reads each input once; the result equals the streaming fold's up to
        float rounding (the order of the additions differs).
        """
        return aggregate_by_folding(self._fold(None), states, weights, name=self.name)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(allow_nonfinite={self.allow_nonfinite}, "
                f"wide={self.wide}, retain={self.retain}, threads={self.threads})")


class AllReduce(_Mean):
    """Element-wise mean; every contributor counts once (weights must be equal)."""

    name = "allreduce"
    weighted = False

    @staticmethod
    def weight(work: float) -> float:
        """Every contributor counts once: ``ωᵢ = 1`` whatever its work."""
        return 1.0


class FedAvg(_Mean):
    """Mean weighted by realized work: ``sum w_i x_i / sum w_i``."""

    name = "fedavg"
    weighted = True
