"""The strict mean's range: a finite value beyond the square root of its sum's largest value
is refused, naming its sender; large values in range are never a false alarm (issue 34)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from meshkit.aggregation import CHUNK_ELEMENTS, ContributionOutOfRange, MeanFold
from meshkit.aggregation._mean import value_limit
from meshkit.errors import AggregationError

F64 = math.sqrt(float(np.finfo(np.float64).max))  # 1.34e154
F32 = math.sqrt(float(np.finfo(np.float32).max))  # 1.84e19


def test_the_limit_is_the_square_root_of_the_sums_largest_value():
    assert value_limit(np.float64) == F64
    assert value_limit(np.float32) == F32
    assert value_limit(ml_dtypes.bfloat16) == F32  # summed in float32, holds up to 3.4e38
    # Every finite value of the dtype is below it: nothing is out of range.
    assert value_limit(np.float16) is None
    assert value_limit(np.float32, wide=True) is None
    assert value_limit(np.int64) is None
    assert MeanFold(allow_nonfinite=True).value_limit(np.float64) is None


def _mean(states, weights=None, **kw):
    fold = MeanFold(**kw)
    for i, state in enumerate(states):
        fold.add(state, 1.0 if weights is None else weights[i], source=f"rank {i + 1}")
    return fold.result()


@pytest.mark.parametrize("size", [7, 3 * CHUNK_ELEMENTS + 5])
@pytest.mark.parametrize("hostile", [1e308, -1e308, 2e154, np.finfo(np.float64).max])
def test_one_contribution_beyond_the_range_is_refused_naming_only_it(size, hostile):
    honest = np.linspace(-3, 3, size)
    bad = honest.copy()
    bad[size // 2] = hostile
    states = [{"w": honest}, {"w": honest * 0.5}, {"w": bad}, {"w": honest}]
    with pytest.raises(AggregationError) as info:
        _mean(states, [10.0, 20.0, 30.0, 40.0])
    assert not isinstance(info.value, ContributionOutOfRange)  # the fold is spent: replayed
    assert "rank 3 sent a value out of range" in str(info.value)
    assert info.value.contributors == ["rank 3"]  # type: ignore[attr-defined]


def test_a_float32_value_beyond_the_range_names_accumulate_float64_as_a_way_out():
    states = [{"w": np.ones(4, np.float32)}, {"w": np.full(4, 1e30, np.float32)}]
    with pytest.raises(AggregationError, match=r"rank 2 sent a value out of range .*"
                                               r'accumulate = "float64"'):
        _mean(states)
    wide = _mean(states, wide=True)["w"]  # in float64 1e30 is in range: averaged
    assert wide.dtype == np.float32 and wide[0] == np.float32((1 + 1e30) / 2)


def test_many_large_values_in_range_are_no_false_alarm():
    # Every value below the limit, but a chunk's sum of squares overflows: the fold's
    # cheap test fires, the element-wise look finds nothing, the mean is exact.
    x = np.full(1000, 1e153)
    with np.errstate(over="ignore"):
        assert not np.isfinite(np.dot(x, x))
    out = _mean([{"w": x}, {"w": x}])
    assert np.array_equal(out["w"], x)
    y = np.full(1000, 1e18, np.float32)
    assert np.array_equal(_mean([{"w": y}, {"w": y}])["w"], y)


def test_nan_is_still_named_as_nan():
    nan = np.zeros(5)
    nan[2] = np.nan
    with pytest.raises(AggregationError, match="rank 2 sent NaN or inf"):
        _mean([{"w": np.full(5, 1e300)}, {"w": nan}])


def test_values_in_range_cannot_overflow_a_float64_sum():
    # Relative weights are at most 2**40 (rebased beyond), so values within 1.34e154 sum
    # far below float64's 1.8e308: with the range refused, the sum cannot overflow.
    x = np.full(3, F64)
    out = _mean([{"w": x}, {"w": -x}, {"w": x}], [1.0, 2.0 ** 40, 2.0 ** 41])
    assert np.isfinite(out["w"]).all()


def test_allow_nonfinite_lets_out_of_range_values_through_too():
    out = _mean([{"w": np.zeros(3)}, {"w": np.full(3, 1e300)}], allow_nonfinite=True)
    assert out["w"].tolist() == [5e299] * 3
