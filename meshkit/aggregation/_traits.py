"""What an aggregator declares it is: :class:`AggregatorTraits`, the record the kernel decides by.

The kernel never asks an aggregator's *name* what it may do; it reads the
aggregator's ``traits`` (DESIGN §10). An aggregator that declares nothing
gets the safe reading: not linear, needs every individual update, takes no
reference, keeps no state. So a third-party rule is refused by secure
aggregation, DP's noised sum, batched exact folds, host relays and spmd
until it says it is linear, and is then accepted wherever ``fedavg`` is.

``linear = True`` is a promise: ``aggregate(states, weights)`` equals
``Σ ωᵢ xᵢ / Σ ωᵢ`` with ``ωᵢ = aggregator.weight(wᵢ)`` (the weight itself
when the aggregator has no ``weight`` method, fedavg's reading), so the
result can be computed from sums alone.
"""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["AggregatorTraits", "aggregator_traits", "linear_weight"]


@attrs.frozen(kw_only=True)
class AggregatorTraits:
    """The declared properties of an aggregator (frozen; compare and hash by value).

    * ``linear``: the result is the weighted mean ``Σ ωᵢ xᵢ / Σ ωᵢ`` (see the
      module docstring); anything computed from sums may stand in for it.
    * ``needs_individual_updates``: the rule reads each contribution on its
      own (a median, Krum); false only for rules that a sum can feed.
    * ``uses_reference``: ``aggregate``/``begin`` take the round's reference
      (the global model sent this round) as ``reference=``.
    * ``stateful``: the rule keeps state across rounds (``state_dict()`` /
      ``load_state_dict()``), checkpointed with the run.
    """

    linear: bool = False
    needs_individual_updates: bool = True
    uses_reference: bool = False
    stateful: bool = False

    def __attrs_post_init__(self) -> None:
        for field in attrs.fields(type(self)):
            value = getattr(self, field.name)
            if not isinstance(value, bool):
                raise TypeError(f"AggregatorTraits.{field.name} must be True or False, "
                                f"got {value!r} ({type(value).__name__})")


#: What an aggregator that declares no ``traits`` is taken to be.
UNDECLARED = AggregatorTraits()


def aggregator_traits(aggregator: Any) -> AggregatorTraits:
    """``aggregator.traits``, or the safe reading :data:`UNDECLARED` when it declares none.

    ``traits`` is the one optional attribute of the contract; a value that is
    not an :class:`AggregatorTraits` is a mistake the plugin author must see.
    """
    traits = getattr(aggregator, "traits", UNDECLARED)
    if not isinstance(traits, AggregatorTraits):
        raise TypeError(
            f"{type(aggregator).__name__}.traits is {traits!r}; declare it as "
            f"meshkit.AggregatorTraits(linear=..., needs_individual_updates=..., "
            f"uses_reference=..., stateful=...)")
    return traits


def linear_weight(aggregator: Any, weight: float) -> float:
    """``ωᵢ`` for a linear aggregator: ``aggregator.weight(w)``, or ``w`` when it has no ``weight``."""
    weigh = getattr(aggregator, "weight", None)
    return float(weigh(weight)) if callable(weigh) else float(weight)
