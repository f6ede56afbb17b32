"""A weight is the realized work: any finite number >= 0, huge or not, shown exactly when refused."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from meshkit.aggregation import MeanFold, check_contributions
from meshkit.errors import AggregationError


def _fold(weights: list[Any], *, weighted: bool = True) -> dict[str, Any]:
    fold = MeanFold(weighted=weighted)
    for i, w in enumerate(weights):
        fold.add({"w": np.full(3, float(i + 1), np.float32)}, w, source=f"rank {i + 1}")
    return fold.result()


def test_huge_finite_weights_are_averaged_not_an_overflow_traceback():
    out = _fold([1e308, 1e308])
    np.testing.assert_array_equal(out["w"], np.full(3, 1.5, np.float32))
    weights = check_contributions([{"w": np.ones(2)}] * 2, [1e308, 1e308])
    assert weights == [1e308, 1e308]


def test_an_integer_weight_beyond_float_range_is_an_aggregation_error():
    with pytest.raises(AggregationError, match="rank 1 has weight"):
        _fold([10 ** 400])


def test_unequal_allreduce_weights_are_shown_so_they_visibly_differ():
    with pytest.raises(AggregationError) as info:
        _fold([0.1, np.float32(0.1)], weighted=False)
    message = str(info.value)
    assert "has weight 0.10000000149011612 but rank 1 has 0.1;" in message
