"""Built-in aggregators: hand-computed means, every strictness error, every refusal."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import meshkit
import meshkit_aggregators
from meshkit import AggregationError, ConfigError, RefusedError
from meshkit.aggregation import MeanFold, begin
from meshkit.plugins import build_manager
from meshkit.state import BFLOAT16


@pytest.fixture(scope="module")
def pset():
    return build_manager([meshkit_aggregators], entry_points=False)


@pytest.fixture
def fedavg(pset):
    return pset.create("aggregator", "fedavg")


@pytest.fixture
def allreduce(pset):
    return pset.create("aggregator", "allreduce")


def f32(*values):
    return np.array(values, dtype=np.float32)


def f64(*values):
    return np.array(values, dtype=np.float64)


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# -- hand-computed means ------------------------------------------------------


def test_fedavg_weights_each_contribution_by_its_realized_work(fedavg):
    # (1*1 + 3*3) / 4 = 2.5 and (2*1 + 6*3) / 4 = 5.0
    out = fedavg.aggregate([{"w": f32(1, 2)}, {"w": f32(3, 6)}], weights=[1, 3])
    np.testing.assert_array_equal(out["w"], f32(2.5, 5.0))
    assert out["w"].dtype == np.float32


def test_fedavg_divides_once_by_the_accepted_mass_of_three_contributors(fedavg):
    # weights 2, 6, 0 (a client that saw no examples): (2*4 + 6*8 + 0*100) / 8 = 7
    states = [{"w": f64(4.0)}, {"w": f64(8.0)}, {"w": f64(100.0)}]
    out = fedavg.aggregate(states, weights=[2, 6, 0])
    assert out["w"].tolist() == [7.0]


def test_fedavg_without_weights_is_the_plain_mean(fedavg):
    out = fedavg.aggregate([{"w": f64(1, 10)}, {"w": f64(2, 20)}, {"w": f64(6, 60)}])
    assert out["w"].tolist() == [3.0, 30.0]


@pytest.mark.parametrize("retain", [0, 1, 2, 4])
def test_fedavg_streaming_fold_matches_the_batch_result(pset, retain):
    fedavg = pset.create("aggregator", "fedavg", {"retain": retain})
    rng = np.random.default_rng(7)
    states = [{"a": rng.standard_normal((5, 3)).astype(np.float32),
               "b": rng.standard_normal(4)} for _ in range(5)]
    weights = [3.0, 1.0, 4.0, 1.0, 5.0]
    batch = fedavg.aggregate(states, weights)
    fold = fedavg.begin()
    for i, (state, weight) in enumerate(zip(states, weights)):
        fold.add(state, weight, source=f"rank {i + 1}")
    streamed = fold.result()
    # The order of the additions differs, so equal up to float rounding.
    np.testing.assert_allclose(streamed["a"], batch["a"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(streamed["b"], batch["b"], rtol=1e-14, atol=1e-15)
    expected = sum(w * s["b"] for s, w in zip(states, weights)) / sum(weights)
    np.testing.assert_allclose(streamed["b"], expected, rtol=1e-14)


def test_a_fold_that_retains_everything_is_the_batch_path_bit_for_bit(fedavg):
    rng = np.random.default_rng(8)
    states = [{"a": rng.standard_normal(9).astype(np.float32)} for _ in range(4)]
    fold = MeanFold(retain=None)
    for state, weight in zip(states, [1, 2, 3, 4]):
        fold.add(state, weight)
    assert same_bits(fold.result()["a"], fedavg.aggregate(states, [1, 2, 3, 4])["a"])


def test_a_zero_first_weight_still_fixes_the_structure_and_adds_nothing(fedavg):
    out = fedavg.aggregate([{"w": f32(50, 50)}, {"w": f32(1, 2)}, {"w": f32(3, 4)}],
                           weights=[0, 1, 1])
    np.testing.assert_array_equal(out["w"], f32(2, 3))


def test_allreduce_is_the_unweighted_element_wise_mean(allreduce):
    states = [{"g": f32(1, -2)}, {"g": f32(2, -4)}, {"g": f32(6, 0)}]
    out = allreduce.aggregate(states)
    np.testing.assert_array_equal(out["g"], f32(3, -2))
    # Equal weights (whatever their value) give the same unweighted mean.
    assert same_bits(allreduce.aggregate(states, [32, 32, 32])["g"], out["g"])


def test_allreduce_refuses_unequal_weights_instead_of_ignoring_them(allreduce):
    fold = allreduce.begin()
    fold.add({"g": f32(1)}, 32, source="rank 1")
    with pytest.raises(AggregationError) as err:
        fold.add({"g": f32(2)}, 16, source="rank 2")
    message = str(err.value)
    assert "rank 2 has weight 16 but rank 1 has 32" in message
    assert "unweighted mean" in message and "use fedavg" in message


@pytest.mark.parametrize("retain", [0, 1, 2, None])
def test_float_arrays_are_folded_across_many_chunks(pset, retain):
    # A chunk of 7 elements makes a 50-element array span 8 chunks, and five
    # contributions exercise grouped folds and a last, odd one.
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(50) for _ in range(5)]
    ws = [1.0, 2.0, 0.5, 4.0, 3.0]
    fold = MeanFold(chunk=7, retain=retain)
    for x, w in zip(xs, ws):
        fold.add({"x": x}, w)
    expected = sum(w * x for x, w in zip(xs, ws)) / sum(ws)
    np.testing.assert_allclose(fold.result()["x"], expected, rtol=1e-13)


def test_non_contiguous_and_zero_dimensional_arrays_are_averaged(fedavg):
    a = np.arange(6, dtype=np.float64).reshape(2, 3)
    out = fedavg.aggregate([{"t": a.T, "s": np.float64(1.0)},
                            {"t": (a * 3).T, "s": np.float64(3.0)}])
    np.testing.assert_array_equal(out["t"], (a * 2).T)
    assert out["s"].shape == () and float(out["s"]) == 2.0


def test_results_keep_the_key_order_of_the_first_contribution(fedavg):
    out = fedavg.aggregate([{"z": f32(1), "a": f32(2), "m": 1},
                            {"a": f32(2), "z": f32(1), "m": 1}])
    assert list(out) == ["z", "a", "m"]


# -- dtypes -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16, np.float32, np.float64,
                                   np.int32, np.int64, np.uint8, np.bool_])
def test_one_contributor_is_the_identity_bit_for_bit(fedavg, dtype):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((3, 4)) * 100).astype(dtype)
    state = {"x": x, "n": 3, "f": 0.1, "meta": {"tag": "a", "lr": [0.5, 2]}}
    out = fedavg.aggregate([state], weights=[7.3])
    assert same_bits(out["x"], x)
    assert out["x"] is not x
    assert out["n"] == 3 and type(out["n"]) is int
    assert out["f"] == 0.1 and out["meta"] == {"tag": "a", "lr": [0.5, 2]}


@pytest.mark.parametrize("retain", [0, 1])
def test_one_bf16_contributor_with_nan_payloads_is_the_identity_bit_for_bit(retain):
    bits = np.array([0x7FC1, 0xFFC0, 0x7F81, 0x7F80, 0x0001, 0x8000, 0x3F80], np.uint16)
    state = {"w": bits.view(BFLOAT16)}
    fold = MeanFold(allow_nonfinite=True, retain=retain)
    fold.add(state, 2.5, source="rank 1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # allowed NaNs are no reason to warn
        out = fold.result()
    assert out["w"].dtype == BFLOAT16
    assert out["w"].view(np.uint16).tolist() == bits.tolist()


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16])
def test_half_precision_accumulates_in_float32_and_returns_its_own_dtype(allreduce, dtype):
    # 256 + 1 + 1: summed in bfloat16 each +1 would round away (256's spacing is 2),
    # giving 256/3 = 85.33 -> 85.5; in float32 it is 258/3 = 86 exactly.
    states = [{"w": np.array([256.0], dtype=dtype)}, {"w": np.array([1.0], dtype=dtype)},
              {"w": np.array([1.0], dtype=dtype)}]
    out = allreduce.aggregate(states)
    assert out["w"].dtype == np.dtype(dtype)
    assert float(out["w"][0]) == 86.0


def test_accumulate_float64_keeps_precision_float32_would_lose(pset):
    # 2**24 + 1 is not a float32; in float64 the sum is exact.
    states = [{"w": f32(2.0 ** 24)}, {"w": f32(1.0)}, {"w": f32(1.0)}, {"w": f32(0.0)}]
    wide = pset.create("aggregator", "allreduce", {"accumulate": "float64"})
    assert wide.aggregate(states)["w"].tolist() == [(2.0 ** 24 + 2) / 4]
    assert wide.aggregate(states)["w"].dtype == np.float32


def test_integer_and_bool_arrays_pass_through_when_identical(fedavg):
    out = fedavg.aggregate([{"steps": np.array([3, 4]), "mask": np.array([True, False])},
                            {"steps": np.array([3, 4]), "mask": np.array([True, False])}],
                           weights=[1, 5])
    assert out["steps"].tolist() == [3, 4] and out["steps"].dtype == np.int64
    assert out["mask"].tolist() == [True, False]


# -- JSON leaves ----------------------------------------------------------------


def test_json_numbers_average_by_weight_objects_by_key_lists_by_position(fedavg):
    a = {"filter": {"mu": 1.0, "sigma": [1, 2.0, 3], "name": "kalman", "on": True,
                    "extra": None}}
    b = {"filter": {"mu": 4.0, "sigma": [3, 2.0, 7], "name": "kalman", "on": True,
                    "extra": None}}
    out = fedavg.aggregate([a, b], weights=[2, 1])
    # mu: (2*1 + 1*4)/3 = 2; sigma: (2*1+3)/3, identical 2.0 passes through, (2*3+7)/3
    assert out == {"filter": {"mu": 2.0, "sigma": [5 / 3, 2.0, 13 / 3], "name": "kalman",
                              "on": True, "extra": None}}


def test_identical_json_numbers_pass_through_unchanged(fedavg):
    out = fedavg.aggregate([{"epoch": 3, "lr": 0.1}] * 3, weights=[1, 2, 7])
    assert out == {"epoch": 3, "lr": 0.1}
    assert type(out["epoch"]) is int


def test_differing_integers_average_to_a_float(allreduce):
    assert allreduce.aggregate([{"n": 1}, {"n": 2}]) == {"n": 1.5}


# -- strictness: every refusal names the key and the contributors ----------------


def refused(aggregator, states, weights=None, sources=None):
    fold = aggregator.begin()
    sources = sources or [f"rank {i + 1}" for i in range(len(states))]
    weights = weights or [1.0] * len(states)
    with pytest.raises(AggregationError) as err:
        for state, weight, source in zip(states, weights, sources):
            fold.add(state, weight, source=source)
        fold.result()
    return err.value


def test_a_key_one_contributor_lacks_is_refused(fedavg):
    err = refused(fedavg, [{"w": f32(1), "b": f32(0)}, {"w": f32(2)}])
    assert str(err) == (
        "fedavg: key 'b' is missing from rank 2, but rank 1 sent it; every contributor "
        "must send the same keys (a mean over whoever has a key would silently re-weight "
        "the others)")
    assert err.key == "b" and err.contributors == ["rank 2", "rank 1"]


def test_a_key_only_a_later_contributor_has_is_refused(fedavg):
    err = refused(fedavg, [{"w": f32(1)}, {"w": f32(2), "extra": f32(3)}])
    assert "rank 2 sent key 'extra', which rank 1 did not" in str(err)


def test_a_shape_that_disagrees_is_refused(fedavg):
    err = refused(fedavg, [{"w": np.zeros((3, 4))}, {"w": np.zeros((4, 3))}])
    assert str(err) == (
        "fedavg: aggregating 'w': rank 2 sent shape (4, 3) where rank 1 sent (3, 4); every "
        "contributor must hold the same model")


def test_a_dtype_that_disagrees_is_refused(fedavg):
    err = refused(fedavg, [{"w": f32(1)}, {"w": np.array([1.0], dtype=BFLOAT16)}])
    assert "aggregating 'w': rank 2 sent dtype bfloat16 where rank 1 sent float32" in str(err)
    assert "cast contributions to one dtype" in str(err)


def test_an_array_where_another_contributor_has_json_is_refused(fedavg):
    err = refused(fedavg, [{"w": f32(1)}, {"w": 1.0}])
    assert "aggregating 'w': rank 2 sent the number 1.0 where rank 1 sent a float32 " \
           "array" in str(err)


def test_integer_arrays_that_differ_are_refused_not_averaged(fedavg):
    err = refused(fedavg, [{"steps": np.array([3])}, {"steps": np.array([4])}])
    assert "rank 2 and rank 1 sent different int64 arrays" in str(err)
    assert "integer and bool arrays are not averaged" in str(err)


def test_a_non_numeric_leaf_that_differs_is_refused(fedavg):
    err = refused(fedavg, [{"meta": {"mode": "train"}}, {"meta": {"mode": "eval"}}])
    assert str(err) == (
        "fedavg: aggregating 'meta.mode': rank 2 sent the string 'eval' where rank 1 sent "
        "the string 'train'; only numbers average, so strings, bools and null must be "
        "identical everywhere")
    assert err.key == "meta.mode"


def test_a_bool_is_not_a_number_to_average(fedavg):
    err = refused(fedavg, [{"on": True}, {"on": 1}])
    assert "aggregating 'on': rank 2 sent the number 1 where rank 1 sent the bool True" \
        in str(err)


def test_json_lists_of_different_lengths_are_refused(fedavg):
    err = refused(fedavg, [{"s": [1, 2]}, {"s": [1, 2, 3]}])
    assert "aggregating 's': rank 2 sent a list of 3 where rank 1 sent a list of 2" in str(err)


def test_json_objects_with_different_keys_are_refused(fedavg):
    err = refused(fedavg, [{"f": {"mu": 1, "k": 2}}, {"f": {"mu": 1}}])
    assert "aggregating 'f': key 'k' is missing from rank 2, but rank 1 sent it" in str(err)


def test_zero_contributors_are_refused(fedavg, allreduce):
    with pytest.raises(AggregationError, match="fedavg: no contributions to aggregate; a "
                                               "round needs at least one contributor"):
        fedavg.aggregate([])
    with pytest.raises(AggregationError, match="allreduce: no contributions"):
        allreduce.begin().result()


@pytest.mark.parametrize("weight, found", [
    (-1.0, "negative weight -1.0"),
    (float("nan"), "non-finite weight nan"),
    (float("inf"), "non-finite weight inf"),
    ("3", "weight '3' (str)"),
    (True, "weight True (bool)"),
])
def test_a_bad_weight_is_refused(fedavg, weight, found):
    fold = fedavg.begin()
    with pytest.raises(AggregationError) as err:
        fold.add({"w": f32(1)}, weight, source="rank 4")
    assert f"fedavg: rank 4 has {found}" in str(err.value)
    assert "(the work the contributor did, e.g. examples seen)" in str(err.value)


def test_weights_that_sum_to_zero_are_refused(fedavg):
    err = refused(fedavg, [{"w": f32(1)}, {"w": f32(2)}], weights=[0, 0])
    assert str(err) == (
        "fedavg: the weights sum to zero (rank 1: 0, rank 2: 0); at least one contributor "
        "must have done some work (weight > 0)")


def test_a_weight_count_that_disagrees_with_the_states_is_refused(fedavg):
    with pytest.raises(AggregationError, match="2 states but 3 weights; give one weight per "
                                               "contribution, or none"):
        fedavg.aggregate([{"w": f32(1)}, {"w": f32(1)}], [1, 1, 1])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("position", [0, 1, 2])
def test_nan_or_inf_in_a_contribution_is_refused_naming_it(fedavg, bad, position):
    states = [{"w": np.ones(20, np.float32)} for _ in range(3)]
    states[position] = {"w": np.ones(20, np.float32)}
    states[position]["w"][13] = bad
    err = refused(fedavg, states)
    assert f"fedavg: aggregating 'w': rank {position + 1} sent NaN or inf; non-finite " \
           f"values are refused by default" in str(err)
    assert "set allow_nonfinite = true" in str(err)
    assert err.contributors == [f"rank {position + 1}"]


def test_nan_in_bfloat16_is_refused(allreduce):
    bad = np.array([1.0, np.nan], dtype=BFLOAT16)
    err = refused(allreduce, [{"w": np.ones(2, BFLOAT16)}, {"w": bad}])
    assert "rank 2 sent NaN or inf" in str(err)


def test_a_non_finite_json_number_is_refused(fedavg):
    err = refused(fedavg, [{"loss": 1.0}, {"loss": float("nan")}])
    assert "aggregating 'loss': rank 2 sent the number nan; non-finite values are refused" \
        in str(err)


def test_allow_nonfinite_lets_nan_through(pset):
    agg = pset.create("aggregator", "fedavg", {"allow_nonfinite": True})
    out = agg.aggregate([{"w": f32(1, np.nan)}, {"w": f32(3, 1)}, {"loss": 1}][:2])
    assert out["w"][0] == 2.0 and np.isnan(out["w"][1])


def test_a_float32_overflow_is_refused_and_float64_accumulation_fixes_it(pset):
    # 3e38 is beyond a float32 sum's range (its square overflows; issue 34): each sender
    # is named, and a float64 sum, whose range holds it, is the way out.
    states = [{"w": f32(3e38)}, {"w": f32(3e38)}]
    err = refused(pset.create("aggregator", "allreduce"), states)
    assert "rank 1 and rank 2 sent a value out of range (|x| up to 3e+38" in str(err)
    assert 'accumulate = "float64"' in str(err)
    wide = pset.create("aggregator", "allreduce", {"accumulate": "float64"})
    assert wide.aggregate(states)["w"].tolist() == [np.float32(3e38)]


def test_an_unsupported_dtype_is_refused(fedavg):
    err = refused(fedavg, [{"z": np.zeros(2, np.complex64)}])
    assert "aggregating 'z': rank 1 sent dtype complex64, which cannot be averaged" in str(err)


def test_a_non_state_contribution_is_refused(fedavg):
    err = refused(fedavg, [[1, 2]])
    assert "rank 1 sent list, expected a state" in str(err)


def test_a_refused_contribution_leaves_the_fold_usable(fedavg):
    fold = fedavg.begin()
    fold.add({"w": f32(1, 1)}, 1, source="rank 1")
    with pytest.raises(AggregationError, match="shape"):
        fold.add({"w": f32(1, 1, 1)}, 1, source="rank 2")
    with pytest.raises(AggregationError, match="negative"):
        fold.add({"w": f32(9, 9)}, -1, source="rank 3")
    fold.add({"w": f32(3, 5)}, 1, source="rank 4")
    np.testing.assert_array_equal(fold.result()["w"], f32(2, 3))
    assert fold.sources == ["rank 1", "rank 4"]


def test_a_fold_is_unusable_after_a_non_finite_contribution(fedavg):
    fold = fedavg.begin()
    fold.add({"w": f32(1)}, source="rank 1")
    with pytest.raises(AggregationError, match="rank 2 sent NaN"):
        fold.add({"w": f32(np.nan)}, source="rank 2")
    with pytest.raises(AggregationError, match="unusable after a refused contribution"):
        fold.add({"w": f32(1)}, source="rank 3")


def test_a_fold_gives_its_result_once(fedavg):
    fold = fedavg.begin()
    fold.add({"w": f32(1)})
    fold.result()
    with pytest.raises(AggregationError, match="already produced its result; begin a new one"):
        fold.result()


def test_default_labels_name_contributors_by_position(fedavg):
    with pytest.raises(AggregationError, match="key 'b' is missing from contributor #1, but "
                                               "contributor #0 sent it"):
        fedavg.aggregate([{"w": f32(1), "b": 1}, {"w": f32(1)}])


# -- refusals ---------------------------------------------------------------------


@pytest.mark.parametrize("name, needs, instead", [
    ("fedprox", "FedProx needs the previous global model on every client to compute its "
                "proximal term", 'Use aggregator "fedavg"'),
    ("fedyogi", "FedYogi needs the optimizer moments carried between rounds",
     'Use aggregator "fedavg" with [outer_optimizer] name = "fedyogi"'),
    ("parameter-server", "which is not an element-wise reduce",
     'Use aggregator "allreduce"'),
])
def test_each_refusal_names_what_it_needs_and_what_works_instead(pset, name, needs, instead):
    with pytest.raises(RefusedError) as err:
        pset.create("aggregator", name)
    assert needs in str(err.value)
    assert instead in str(err.value)


def test_refusals_are_listed_with_what_to_use_instead(pset):
    available = pset.available("aggregator")
    assert {"allreduce", "fedavg", "fedprox", "fedyogi", "parameter-server"} <= set(available)
    for name in ("fedprox", "fedyogi", "parameter-server"):
        assert available[name].summary.startswith("refusal: ")


def test_retain_must_be_a_count(pset):
    with pytest.raises(ConfigError, match="retain must be an integer >= 0, got -1"):
        pset.create("aggregator", "fedavg", {"retain": -1})
    with pytest.raises(ValueError, match="retain must be an integer >= 0 or None"):
        MeanFold(retain=1.5)


def test_an_unknown_option_is_a_config_error(pset):
    with pytest.raises(ConfigError, match="accumulate must be one of 'auto', 'float64'"):
        pset.create("aggregator", "fedavg", {"accumulate": "float16"})
    with pytest.raises(ConfigError, match="trim"):
        pset.create("aggregator", "fedavg", {"trim": 0.1})


def test_the_aggregators_are_offered_through_the_public_api():
    assert "fedavg" in meshkit.plugins.available("aggregator")
    fold = begin(meshkit.plugins.create("aggregator", "fedavg"))
    fold.add({"w": f32(2)}, 3)
    assert fold.result()["w"].tolist() == [2.0]


# -- numerics and memory ----------------------------------------------------------


def test_weights_spanning_a_huge_range_do_not_overflow_the_relative_factors(fedavg):
    # The first positive weight is the reference; a later one 1e40 times larger
    # would overflow a float32 factor, so the fold rebases instead.
    states = [{"w": f32(1.0), "j": 1.0}, {"w": f32(2.0), "j": 2.0},
              {"w": f32(4.0), "j": 4.0}]
    out = fedavg.aggregate(states, weights=[1e-30, 1e10, 1e10])
    np.testing.assert_allclose(out["w"], f32(3.0), rtol=1e-6)
    assert out["j"] == pytest.approx(3.0, rel=1e-12)


def test_the_fold_holds_at_most_two_model_copies_whatever_the_contributors(fedavg):
    import tracemalloc

    # 3.2 MB, so the fold's fixed scratch (three 256 KiB chunks) stays small beside it.
    model = {f"p{i}": np.ones(200_000, np.float32) for i in range(4)}
    model_bytes = sum(v.nbytes for v in model.values())
    tracemalloc.start()
    try:
        fold = fedavg.begin()
        for i in range(12):
            fold.add(model, weight=i + 1)
        result = fold.result()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result["p0"][0] == 1.0
    assert peak <= 2 * model_bytes, f"peak {peak} bytes for a {model_bytes}-byte model"


# -- check_contributions, for plain third-party aggregators --------------------------


def test_check_contributions_refuses_what_the_built_ins_refuse():
    from meshkit.aggregation import check_contributions

    good = [{"w": f32(1, 2), "steps": np.array([3]), "m": {"tag": "a", "x": 1.0}},
            {"w": f32(3, 4), "steps": np.array([3]), "m": {"tag": "a", "x": 2.0}}]
    assert check_contributions(good, [2, 3], name="median") == [2.0, 3.0]
    assert check_contributions(good, name="median") == [1.0, 1.0]
    cases = [
        ([], None, "median: no contributions to aggregate"),
        (good, [1], "median: 2 states but 1 weights"),
        (good, [1, -1], "median: contributor #1 has negative weight -1.0"),
        (good, [0, 0], "median: the weights sum to zero"),
        ([good[0], {**good[1], "w": f32(1, 2, 3)}], None,
         "median: aggregating 'w': contributor #1 sent shape (3,) where contributor #0 "
         "sent (2,)"),
        ([good[0], {**good[1], "steps": np.array([4])}], None,
         "contributor #1 and contributor #0 sent different int64 arrays"),
        ([good[0], {"w": f32(1, 2), "steps": np.array([3])}], None,
         "median: key 'm' is missing from contributor #1"),
        ([good[0], {**good[1], "m": {"tag": "b", "x": 1.0}}], None,
         "aggregating 'm.tag': contributor #1 sent the string 'b'"),
    ]
    for states, weights, message in cases:
        with pytest.raises(AggregationError) as err:
            check_contributions(states, weights, name="median")
        assert message in str(err.value)


def test_the_batch_path_names_the_contributor_that_sent_nan(fedavg):
    states = [{"w": np.ones(30, np.float32)} for _ in range(7)]
    states[5] = {"w": np.ones(30, np.float32)}
    states[5]["w"][29] = np.inf
    with pytest.raises(AggregationError) as err:
        fedavg.aggregate(states)
    assert "aggregating 'w': contributor #5 sent NaN or inf" in str(err.value)
    assert err.value.contributors == ["contributor #5"]


def test_two_contributors_with_nan_in_one_group_are_both_named(fedavg):
    bad = {"w": f32(np.nan, 1)}
    with pytest.raises(AggregationError) as err:
        fedavg.aggregate([{"w": f32(1, 1)}, bad, bad])
    assert "contributor #1 and contributor #2 sent NaN or inf" in str(err.value)
