"""An update's norm and norm clipping (meshkit.aggregation.global_norm, clip_update)."""

from __future__ import annotations

import numpy as np
import pytest

from meshkit.aggregation import clip_update, global_norm
from meshkit.state import BFLOAT16


def test_the_norm_is_over_every_numeric_array_leaf_together_json_ignored():
    update = {"a": np.array([3.0], np.float32), "b": np.array([[4.0]]), "c": {"lr": 100.0},
              "n": np.array([0], np.int64)}
    assert global_norm(update) == 5.0


def test_clipping_scales_every_leaf_by_one_factor_and_keeps_dtypes():
    update = {"a": np.array([3.0, 0.0], np.float32), "b": np.array([4.0], BFLOAT16),
              "meta": {"x": 1}}
    clipped, norm = clip_update(update, 1.0)
    assert norm == 5.0
    assert clipped["a"].dtype == np.float32 and clipped["b"].dtype == BFLOAT16
    np.testing.assert_allclose(clipped["a"], [0.6, 0.0], rtol=1e-6)
    np.testing.assert_allclose(clipped["b"].astype(np.float64), [0.8], rtol=1e-2)
    assert clipped["meta"] == {"x": 1}
    assert global_norm(clipped) == pytest.approx(1.0, rel=1e-2)


@pytest.mark.parametrize("update", [{"a": np.zeros(3)}, {"a": np.array([0.3, 0.4])}])
def test_a_zero_or_short_update_is_unchanged(update):
    clipped, norm = clip_update(update, 1.0)
    np.testing.assert_array_equal(clipped["a"], update["a"])
    assert norm == global_norm(update)


def test_a_negative_clip_norm_is_refused():
    with pytest.raises(ValueError, match="clip_norm must be a finite number >= 0"):
        clip_update({"a": np.ones(2)}, -1.0)


def test_the_norm_spans_every_numeric_array_and_ignores_json_leaves() -> None:
    update = {"a": np.array([3.0], np.float32), "b": np.array([[4.0]], np.float16),
              "n": np.array([0], np.int64), "meta": {"lr": 100.0}, "tag": "x"}
    assert global_norm(update) == 5.0


def test_clipping_scales_every_array_by_one_factor_in_its_own_dtype() -> None:
    update = {"a": np.array([3.0], np.float32), "b": np.array([4.0], np.float64),
              "meta": {"k": 1}}
    clipped, norm = clip_update(update, 1.0)
    assert norm == 5.0
    assert clipped["a"].dtype == np.float32 and clipped["b"].dtype == np.float64
    np.testing.assert_allclose([clipped["a"][0], clipped["b"][0]], [0.6, 0.8], rtol=1e-6)
    assert clipped["meta"] == {"k": 1}
    assert global_norm(clipped) == pytest.approx(1.0, rel=1e-6)


def test_an_update_within_the_bound_or_of_norm_zero_is_unchanged() -> None:
    small = {"a": np.array([0.1, 0.2])}
    same, norm = clip_update(small, 1.0)
    np.testing.assert_array_equal(same["a"], small["a"])
    zero, norm = clip_update({"a": np.zeros(3)}, 0.0)
    assert norm == 0.0 and not zero["a"].any()


@pytest.mark.parametrize("magnitude", [1e155, 1e300, -1e300])
def test_a_finite_update_whose_squares_overflow_has_its_true_norm(magnitude) -> None:
    update = {"a": np.full(4, magnitude), "b": np.full(5, magnitude)}
    np.testing.assert_allclose(global_norm(update), abs(magnitude) * 3.0, rtol=1e-15)
    clipped, norm = clip_update(update, 1.0)
    np.testing.assert_allclose(norm, abs(magnitude) * 3.0, rtol=1e-15)
    np.testing.assert_allclose(clipped["a"], np.sign(magnitude) / 3.0, rtol=1e-15)


def test_a_norm_past_float_range_is_inf() -> None:
    assert global_norm({"a": np.full(4, 1.7e308)}) == np.inf
