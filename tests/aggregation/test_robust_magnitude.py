"""Robust rules stay robust at every finite magnitude (issue 34).

One contribution of ten at 1e100, 1e155 (its square overflows float64) or
1e300 must not move a robust rule out of the honest contributions' range,
nor turn it into NaN; the clipping rules clip it to their radius instead of
refusing it as "non-finite" or zeroing it. And a claimed example count
cannot buy the geometric median.
"""

from __future__ import annotations

import numpy as np
import pytest

import meshkit

MAGNITUDES = [1e100, 1e155, 1e300, -1e300]
HONEST = np.random.default_rng(0).uniform(-1.0, 3.77, size=(9, 8))


def _round(magnitude: float) -> list[dict]:
    rows = np.vstack([HONEST[:4], np.full((1, 8), magnitude), HONEST[4:]])
    return [{"w": row.copy()} for row in rows]


@pytest.mark.parametrize("magnitude", MAGNITUDES)
@pytest.mark.parametrize("name,options", [
    ("geometric-median", {}), ("median", {}), ("trimmed-mean", {}), ("krum", {"f": 1}),
    ("multi-krum", {"f": 1}), ("bulyan", {"f": 1})])
def test_one_huge_contribution_leaves_the_result_in_the_honest_range(name, options, magnitude):
    out = meshkit.plugins.create("aggregator", name, options).aggregate(_round(magnitude))["w"]
    assert np.isfinite(out).all(), f"{name} at {magnitude:g}: {out}"
    low, high = HONEST.min(axis=0), HONEST.max(axis=0)
    assert ((out >= low) & (out <= high)).all(), (
        f"{name} at {magnitude:g} left the honest range: {out} not in [{low}, {high}]")


@pytest.mark.parametrize("magnitude", MAGNITUDES)
def test_the_geometric_median_barely_moves_whatever_the_magnitude(magnitude):
    agg = meshkit.plugins.create("aggregator", "geometric-median")
    at_100 = agg.aggregate(_round(np.copysign(100.0, magnitude)))["w"]
    out = agg.aggregate(_round(magnitude))["w"]
    # Past the honest rows, the outlier pulls with the same unit force at any distance.
    np.testing.assert_allclose(out, at_100, atol=0.05)


@pytest.mark.parametrize("magnitude", MAGNITUDES)
@pytest.mark.parametrize("name,options", [("centered-clipping", {"tau": 1.0}),
                                          ("norm-bound", {"max_norm": 1.0})])
def test_a_huge_update_is_clipped_to_the_radius_not_refused_or_zeroed(name, options,
                                                                      magnitude):
    reference = {"w": np.zeros(8)}
    agg = meshkit.plugins.create("aggregator", name, options)
    out = agg.aggregate(_round(magnitude), reference=reference)["w"]
    # The same round with the outlier replaced by its clipped self: a vector of norm 1.
    clipped = np.full(8, np.sign(magnitude) / np.sqrt(8))
    rows = np.vstack([HONEST[:4], clipped, HONEST[4:]])
    expected = meshkit.plugins.create("aggregator", name, options).aggregate(
        [{"w": r} for r in rows], reference=reference)["w"]
    np.testing.assert_allclose(out, expected, rtol=1e-9, atol=1e-12)


def test_a_claimed_example_count_does_not_buy_the_geometric_median():
    rows = [{"w": r.copy()} for r in HONEST] + [{"w": np.full(8, 50.0)}]
    agg = meshkit.plugins.create("aggregator", "geometric-median")
    equal = agg.aggregate(rows, [1.0] * 10)["w"]
    bought = agg.aggregate(rows, [1.0] * 9 + [2.0 ** 53])["w"]
    np.testing.assert_array_equal(bought, equal)
    assert (bought <= HONEST.max(axis=0)).all()
