"""AggregatorTraits: the record the kernel decides by, and its safe default."""

from __future__ import annotations

import pytest

import meshkit
from meshkit.aggregation import AggregatorTraits, aggregator_traits, linear_weight


def test_an_aggregator_that_declares_nothing_gets_the_safe_reading() -> None:
    class Plain:
        def aggregate(self, states, weights=None):  # pragma: no cover - never called
            return {}

    traits = aggregator_traits(Plain())
    assert traits == AggregatorTraits()
    assert not traits.linear and traits.needs_individual_updates
    assert not traits.uses_reference and not traits.stateful


def test_declared_traits_are_read_and_a_wrong_type_is_named() -> None:
    class Linear:
        traits = AggregatorTraits(linear=True, needs_individual_updates=False)

    assert aggregator_traits(Linear()).linear

    class Wrong:
        traits = {"linear": True}

    with pytest.raises(TypeError, match="meshkit.AggregatorTraits"):
        aggregator_traits(Wrong())
    with pytest.raises(TypeError, match="linear must be True or False"):
        AggregatorTraits(linear=1)  # type: ignore[arg-type]


def test_linear_weight_is_the_weight_unless_the_aggregator_reweighs() -> None:
    class Equal:
        def weight(self, w: float) -> float:
            return 1.0

    assert linear_weight(object(), 7.0) == 7.0
    assert linear_weight(Equal(), 7.0) == 1.0
    assert meshkit.AggregatorTraits is AggregatorTraits
