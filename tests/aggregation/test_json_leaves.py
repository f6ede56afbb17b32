"""JSON leaves in the fold: numbers beyond float range, sums that overflow, nesting past the bound."""

from __future__ import annotations

import numpy as np
import pytest

from meshkit import plugins
from meshkit.aggregation import MeanFold, begin
from meshkit.errors import AggregationError, StateError
from meshkit.state import MAX_JSON_DEPTH, validate_state


@pytest.mark.parametrize("values", [[10 ** 400, 10 ** 400], [1, 10 ** 400], [10 ** 400, 1]])
def test_a_json_integer_beyond_float_range_is_an_aggregation_error(values):
    fold = MeanFold()
    with pytest.raises(AggregationError, match=r"aggregating 'cfg\.n'") as info:
        for i, v in enumerate(values):
            fold.add({"cfg": {"n": v}}, 1.0, source=f"rank {i + 1}")
        fold.result()
    assert "float64" in str(info.value)


@pytest.mark.parametrize("weights", [[1.0, 1.0], [1.0, 1e6]])
def test_a_json_number_whose_weighted_sum_overflows_is_refused_not_inf(weights):
    fold = MeanFold()
    fold.add({"w": np.ones(2, np.float32), "cfg": {"big": 1e303 * 1e5}}, weights[0],
             source="rank 1")
    fold.add({"w": np.ones(2, np.float32), "cfg": {"big": 1.5e303 * 1e5}}, weights[1],
             source="rank 2")
    with pytest.raises(AggregationError, match=r"aggregating 'cfg\.big'.*overflowed") as info:
        fold.result()
    assert info.value.contributors == ["rank 1", "rank 2"]


def test_json_numbers_that_do_not_overflow_still_average():
    fold = MeanFold()
    fold.add({"cfg": {"big": 1e300}}, 1.0)
    fold.add({"cfg": {"big": 3e300}}, 1.0)
    assert fold.result() == {"cfg": {"big": 2e300}}


def _nested(depth: int):
    value = 0
    for _ in range(depth):
        value = [value]
    return value


def test_json_nested_past_the_bound_is_refused_not_a_recursion_error():
    """A 900-deep JSON leaf decoded fine and then blew the fold's stack."""
    deep = {"meta": _nested(900)}
    fold = begin(plugins.create("aggregator", "fedavg"))
    with pytest.raises(AggregationError, match="nested more than 64 levels"):
        fold.add(deep, 1.0, source="rank 1")
    with pytest.raises(StateError, match="nested more than 64 levels"):
        validate_state(deep)
    ok = {"meta": _nested(MAX_JSON_DEPTH)}
    validate_state(ok)
    fold = begin(plugins.create("aggregator", "fedavg"))
    fold.add(ok, 1.0, source="rank 1")
    fold.add(ok, 3.0, source="rank 2")
    assert fold.result() == ok
