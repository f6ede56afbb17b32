"""What a sum may stand in for: the exact mean behind a linear aggregator, and the refusal.

Rule: the round paths that compute an aggregate from sums -- batched rounds
(each worker's exact partial), host relays (one partial per relay), torchrun's
spmd rounds (one all-reduce), secure aggregation (the masked sum) and DP's
noised sum -- may play an aggregator's round only when its
:class:`~meshkit.AggregatorTraits` declare it ``linear``. They ask here, and
never an aggregator's name.

:func:`exact_mean` gives the strict mean such a path folds into: the
aggregator's own fold when it *is* the kernel's :class:`MeanFold` (the
built-in ``fedavg`` and ``allreduce``, with their settings), else a weighted
:class:`MeanFold` standing in for the linear rule. A remote fold (a worker's
batch, a relay) weighs contributions by their realized work or counts each
once; a linear rule with a ``weight(w)`` of its own cannot travel there (the
wire carries no function), so for it :func:`exact_mean` says None and the
round folds flat through the rule's own fold -- correct, only not batched.
spmd applies ``weight(w)`` itself: every rank holds the aggregator.
"""

from __future__ import annotations

from typing import Any

from meshkit.aggregation._mean import MeanFold
from meshkit.aggregation._traits import aggregator_traits
from meshkit.errors import RefusedError

__all__ = ["exact_mean", "refuse_unless_linear"]


def exact_mean(aggregator: Any, fold: Any) -> MeanFold | None:
    """The strict mean a round of ``aggregator`` may fold its sums into, or None (module doc).

    ``fold`` is the round's fold, already begun from ``aggregator``.
    """
    if not aggregator_traits(aggregator).linear:
        return None
    if isinstance(fold, MeanFold):
        return fold
    if callable(getattr(aggregator, "weight", None)):
        return None
    name = getattr(aggregator, "name", None) or type(aggregator).__name__
    return MeanFold(weighted=True, name=str(name))


def refuse_unless_linear(aggregator: Any, *, where: str, needs: str, instead: str) -> None:
    """:class:`RefusedError` unless ``aggregator`` declares ``traits.linear``.

    ``where`` names the config keys (``"runs.toml: [privacy] name = 'dp-fixed' with
    [aggregator] name = 'median'"``), ``needs`` what the path computes from sums,
    ``instead`` what works.
    """
    traits = aggregator_traits(aggregator)
    if traits.linear:
        return
    declared = ("declares no traits" if getattr(aggregator, "traits", None) is None
                else f"declares {traits!r}")
    raise RefusedError(
        f"{where}: {needs}, which only a linear aggregator can be computed from; this one "
        f"{declared}, so it lacks the trait AggregatorTraits.linear = True (a weighted mean "
        f"of its contributions, exact from sums; docs/aggregators.md, \"Traits\"). {instead}")
