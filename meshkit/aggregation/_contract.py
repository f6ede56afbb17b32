"""The aggregator contract: what an aggregator and its fold are, and how a weight is checked.

An *aggregator* combines contributions (states) into one state with
``aggregate(states, weights=None)``; a *streaming* one also offers
``begin()``, a fold that takes the contributions one at a time
(``add(state, weight, source=...)``) and gives the aggregate once
(``result()``). Every weight is checked here, by :func:`check_weight`, and a
contribution without a label is named by :func:`default_source`.

Two optional parts of the contract, both declared by the aggregator:

* **The round's reference.** An aggregator whose ``traits``
  (:class:`~meshkit.AggregatorTraits`) declare ``uses_reference`` is given the global state the round started from (the model sent to the
  clients): ``aggregate(states, weights, reference=ref)`` and
  ``begin(reference=ref)``. Rules that measure or clip *updates*
  (``contribution - reference``) need it; ``reference=None`` means the
  contributions are updates already (gradients), i.e. a zero reference.
  :func:`uses_reference` asks; :func:`meshkit.aggregation.begin` passes it.
* **State across rounds.** An aggregator with ``state_dict()`` and
  ``load_state_dict(d)`` (centered clipping's centre) is checkpointed with
  the run beside the outer optimizer's state and restored on ``--resume``;
  :func:`aggregator_state` and :func:`load_aggregator_state` are how the
  runner asks.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

from meshkit.aggregation._messages import short
from meshkit.aggregation._traits import aggregator_traits
from meshkit.errors import AggregationError
from meshkit.state import State


@runtime_checkable
class Fold(Protocol):
    """One round of streaming aggregation."""

    def add(self, state: State, weight: float = 1.0, *, source: str | None = None) -> None:
        """Fold in one contribution; ``source`` names it in error messages."""

    def result(self) -> dict[str, Any]:
        """The aggregate of everything added (call once)."""


@runtime_checkable
class Aggregator(Protocol):
    """Anything that combines states: the one method every aggregator has."""

    def aggregate(self, states: Sequence[State],
                  weights: Sequence[float] | None = None) -> dict[str, Any]:
        """Combine ``states`` (optionally weighted) into one state."""


@runtime_checkable
class StreamingAggregator(Aggregator, Protocol):
    """An aggregator that can also fold contributions as they arrive."""

    def begin(self) -> Fold:
        """A fresh fold for one round."""


def uses_reference(aggregator: Any) -> bool:
    """Whether ``aggregator`` takes the round's reference (its ``traits.uses_reference``)."""
    return aggregator_traits(aggregator).uses_reference


def aggregator_state(aggregator: Any) -> dict[str, Any]:
    """What ``aggregator`` carries across rounds (``state_dict()``), ``{}`` for a stateless one."""
    state_dict = getattr(aggregator, "state_dict", None)
    return dict(state_dict()) if callable(state_dict) else {}


def load_aggregator_state(aggregator: Any, state: Mapping[str, Any]) -> None:
    """Restore what :func:`aggregator_state` saved; refuses state for a stateless aggregator."""
    load = getattr(aggregator, "load_state_dict", None)
    if not callable(load):
        if state:
            raise AggregationError(
                f"{getattr(aggregator, 'name', type(aggregator).__name__)}: the checkpoint "
                f"carries aggregator state ({', '.join(sorted(state))}) but this aggregator "
                f"keeps none; resume with the aggregator that wrote it")
        return
    load(dict(state))


def default_source(index: int) -> str:
    """The label of the ``index``-th contribution when the caller gives none."""
    return f"contributor #{index}"


def check_weight(weight: Any, source: str, *, name: str = "aggregator") -> float:
    """A contribution's weight as a float, or :class:`AggregationError` saying why not."""
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
        raise AggregationError(
            f"{name}: {source} has weight {weight!r} ({type(weight).__name__}); a weight "
            f"must be a number >= 0 (the work the contributor did, e.g. examples seen)")
    try:
        value = float(weight)
    except OverflowError:  # an int beyond float range
        raise AggregationError(
            f"{name}: {source} has weight {short(weight)}, beyond the float range; only "
            f"the weights' ratios matter, so scale them down") from None
    if not math.isfinite(value):
        raise AggregationError(
            f"{name}: {source} has non-finite weight {value!r}; weights must be finite "
            f"numbers >= 0 (the work the contributor did, e.g. examples seen)")
    if value < 0:
        raise AggregationError(
            f"{name}: {source} has negative weight {value!r}; weights must be >= 0 "
            f"(the work the contributor did, e.g. examples seen)")
    return value


def aggregate_by_folding(fold: Fold, states: Sequence[State],
                         weights: Sequence[float] | None = None,
                         *, name: str = "aggregator") -> dict[str, Any]:
    """Batch ``aggregate`` implemented through a fold (labels ``contributor #i``)."""
    states = list(states)
    if weights is not None:
        weights = list(weights)
        if len(weights) != len(states):
            raise AggregationError(
                f"{name}: {len(states)} states but {len(weights)} weights; give one weight "
                f"per contribution, or none")
    for i, state in enumerate(states):
        fold.add(state, 1.0 if weights is None else weights[i], source=default_source(i))
    return fold.result()
