"""FixedPointSum: exact, order-free weighted sums, and the partial that crosses the wire."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from meshkit import AggregationError
from meshkit.aggregation import FixedPartial, FixedPointSum, MeanFold
from meshkit.state import BFLOAT16


def _state(rng: np.random.Generator, scale: float = 1.0) -> dict:
    return {"w": (rng.standard_normal((3, 4)) * scale).astype(np.float32),
            "b": (rng.standard_normal(5) * scale).astype(np.float64),
            "steps": np.array([7, 8], dtype=np.int64),
            "meta": {"lr": 0.1, "name": "mlp", "loss": [float(rng.random()), 2]}}


def _contributions(n: int, seed: int = 0) -> list[tuple[dict, float]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        state = _state(rng)
        state["meta"] = {"lr": 0.1, "name": "mlp", "loss": [float(rng.random()), 2]}
        out.append((state, float(rng.integers(1, 50))))
    return out


def _bits(state: dict) -> dict:
    return {k: (v.dtype.str, v.tobytes()) if isinstance(v, np.ndarray) else repr(v)
            for k, v in state.items()}


def _sum(parts, order=None, bits=32) -> FixedPointSum:
    total = FixedPointSum(fraction_bits=bits)
    for i in (order if order is not None else range(len(parts))):
        state, weight = parts[i]
        total.add(state, weight, source=f"client {i}")
    return total


@settings(max_examples=25, deadline=None)
@given(hst.integers(1, 9), hst.integers(0, 2 ** 32 - 1), hst.data())
def test_any_order_and_any_split_give_the_same_bits(n, seed, data):
    parts = _contributions(n, seed)
    flat = _sum(parts).result()
    order = data.draw(hst.permutations(range(n)))
    cuts = sorted(data.draw(hst.lists(hst.integers(0, n), max_size=3)))
    groups = [order[a:b] for a, b in zip([0, *cuts], [*cuts, n])]
    total = FixedPointSum()
    for group in reversed(groups):  # partials merged in yet another order
        if not group:
            continue
        wire = _sum(parts, group).partial().to_wire()
        total.merge(FixedPartial.from_wire(wire), source="worker")
    assert _bits(total.result()) == _bits(flat)


def test_the_mean_agrees_with_meanfold_far_below_float32_rounding():
    parts = _contributions(20, seed=3)
    exact = _sum(parts).result()
    mean = MeanFold(wide=True)
    for state, weight in parts:
        mean.add(state, weight)
    reference = mean.result()
    for key in ("w", "b"):
        assert exact[key].dtype == reference[key].dtype
        np.testing.assert_allclose(exact[key], reference[key], rtol=2e-7, atol=1e-9)
    assert exact["meta"]["lr"] == 0.1 and exact["meta"]["name"] == "mlp"
    assert exact["meta"]["loss"][1] == 2 and type(exact["meta"]["loss"][1]) is int
    assert exact["meta"]["loss"][0] == pytest.approx(reference["meta"]["loss"][0], rel=1e-9)
    np.testing.assert_array_equal(exact["steps"], [7, 8])


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16, np.float32, np.float64])
def test_each_float_dtype_comes_back_in_its_own_dtype(dtype):
    total = FixedPointSum()
    total.add({"x": np.array([1.5, -2.0], dtype=dtype)}, 1.0)
    total.add({"x": np.array([0.5, 4.0], dtype=dtype)}, 3.0)
    out = total.result()["x"]
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out.astype(np.float64), [0.75, 2.5])


def test_nan_is_refused_and_leaves_the_sum_unchanged():
    total = FixedPointSum()
    total.add({"x": np.ones(3, dtype=np.float32)}, 2.0)
    with pytest.raises(AggregationError, match="client 9 sent NaN or inf"):
        total.add({"x": np.array([1, np.nan, 1], dtype=np.float32)}, 1.0, source="client 9")
    assert total.count == 1
    np.testing.assert_array_equal(total.result()["x"], np.ones(3, dtype=np.float32))


def test_an_overflowing_sum_is_refused_before_it_happens_saying_the_range():
    total = FixedPointSum(fraction_bits=32)
    big = {"x": np.array([1e9], dtype=np.float64)}
    total.add(big, 1.0)
    total.add(big, 1.0)  # 2e9 < 2**31
    with pytest.raises(AggregationError, match=r"could overflow.*2\.14748e\+09.*fraction_bits"):
        total.add(big, 1.0, source="client 3")
    assert total.count == 2
    assert total.result()["x"][0] == 1e9
    with pytest.raises(AggregationError, match="beyond the range"):
        FixedPointSum().add({"x": np.array([1e300])}, 1e10)


def test_merging_partials_that_could_overflow_is_refused():
    one = FixedPointSum()
    one.add({"x": np.array([1.5e9])}, 1.0)
    other = FixedPointSum()
    other.add({"x": np.array([1.5e9])}, 1.0)
    total = FixedPointSum()
    total.merge(one.partial())
    with pytest.raises(AggregationError, match="could overflow"):
        total.merge(other.partial(), source="worker 2")


def test_contributions_that_disagree_are_refused_naming_both():
    total = FixedPointSum()
    total.add({"x": np.zeros(2, np.float32), "n": np.array([1])}, source="client 0")
    with pytest.raises(AggregationError, match="client 1.*client 0"):
        total.add({"x": np.zeros(3, np.float32), "n": np.array([1])}, source="client 1")
    with pytest.raises(AggregationError, match="must be identical"):
        total.add({"x": np.zeros(2, np.float32), "n": np.array([2])}, source="client 1")
    with pytest.raises(AggregationError, match="same keys"):
        total.add({"x": np.zeros(2, np.float32)}, source="client 1")
    with pytest.raises(AggregationError, match="zero"):
        zero = FixedPointSum()
        zero.add({"x": np.zeros(1)}, 0.0)
        zero.result()


def test_a_partial_in_other_units_is_refused():
    coarse = FixedPointSum(fraction_bits=16)
    coarse.add({"x": np.ones(1)}, 1.0)
    with pytest.raises(AggregationError, match="same fraction_bits"):
        FixedPointSum(fraction_bits=32).merge(coarse.partial())


@pytest.mark.parametrize("tamper, match", [
    (lambda w: w.update({"f:w": w["f:w"].astype(np.float64)}), "int64"),
    (lambda w: w.update({"count": -1}), "count"),
    (lambda w: w.update({"count": True}), "integer"),
    (lambda w: w.update({"mass": 1 << 200}), "mass"),
    (lambda w: w.pop("t:w"), "dtype"),
    (lambda w: w.update({"t:w": "int32"}), "not a float"),
    (lambda w: w.update({"f:w": np.full(12, -(1 << 63), dtype=np.int64)}), "-2\\*\\*63"),
    (lambda w: w.update({"js:meta": np.zeros(9, dtype=np.int64)}), "do not match"),
    (lambda w: w.update({"zz": 1}), "unknown entry"),
])
def test_a_hostile_partial_on_the_wire_is_refused(tamper, match):
    parts = _contributions(2)
    wire = _sum(parts).partial().to_wire()
    tamper(wire)
    with pytest.raises(AggregationError, match=match):
        FixedPartial.from_wire(wire, what="rank 2's partial")


def test_a_partial_is_checked_against_the_model_signature():
    parts = _contributions(1)
    partial = _sum(parts).partial()
    model = parts[0][0]
    signature = {k: (v.shape, v.dtype) if isinstance(v, np.ndarray) else None
                 for k, v in model.items()}
    assert partial.matches(signature) is None
    signature["w"] = ((4, 3), np.dtype(np.float32))
    assert "where the model has float32[4, 3]" in partial.matches(signature)


def test_a_handed_on_sum_takes_nothing_more():
    total = FixedPointSum()
    total.add({"x": np.ones(1)})
    total.partial()
    with pytest.raises(AggregationError, match="handed on"):
        total.add({"x": np.ones(1)})


def test_a_small_all_float_model_sums_to_the_exact_integers_whatever_the_order():
    rng = np.random.default_rng(5)
    parts = [({"w": rng.standard_normal((4, 3)).astype(np.float32),
               "b": rng.standard_normal(3)}, float(rng.integers(1, 9))) for _ in range(6)]
    one = 2.0 ** 32
    exact = {k: sum(np.rint(s[k].astype(np.float64) * (w * one)).astype(object)
                    for s, w in parts) for k in ("w", "b")}
    mass = sum(round(w * one) for _, w in parts)
    for order in (range(6), [5, 0, 3, 1, 4, 2]):
        total = FixedPointSum()
        for i in order:
            total.add(*parts[i])
        partial = total.partial()
        for key in ("w", "b"):
            assert partial.sums[key].tolist() == exact[key].tolist()
        assert partial.mass == mass


def test_a_small_model_refuses_nan_and_overflow_without_changing_its_sum():
    total = FixedPointSum()
    total.add({"x": np.ones(4, np.float32)}, 1.0)
    with pytest.raises(AggregationError, match="client 1 sent NaN"):
        total.add({"x": np.array([1, 1, np.inf, 1], np.float32)}, 1.0, source="client 1")
    big = {"x": np.full(4, 1.5e9, np.float32)}
    total.add(big, 1.0)
    with pytest.raises(AggregationError, match="could overflow"):
        total.add(big, 1.0, source="client 3")
    assert total.count == 2
    np.testing.assert_array_equal(total.result()["x"], np.full(4, 7.5e8 + 0.5, np.float32))


def test_a_partial_received_as_views_keeps_0d_arrays_and_the_models_key_order():
    state = {"w": np.ones((2, 2), np.float32), "n": np.array(3, np.int64),
             "count": np.array(2.0), "meta": {"a": 1}}
    total = FixedPointSum()
    total.add(state, 2.0)
    wire = total.partial().to_wire()
    # As the wire hands them over: views into a receive buffer.
    viewed = {k: (np.frombuffer(v.tobytes(), v.dtype).reshape(v.shape)
                  if isinstance(v, np.ndarray) else v) for k, v in wire.items()}
    merged = FixedPointSum()
    merged.merge(FixedPartial.from_wire(viewed))
    out = merged.result()
    assert list(out) == list(state)
    assert out["count"].shape == () and out["n"].shape == () and out["w"].shape == (2, 2)
    assert out["count"] == 2.0 and out["n"] == 3
