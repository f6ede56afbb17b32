"""The state model's validation and dtype helpers."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import meshkit
from meshkit import state as st
from meshkit.errors import WireError
from meshkit.state import BFLOAT16, StateError, validate_state
from meshkit.wire import decode_state, encode_state


def test_bfloat16_is_a_real_numpy_dtype():
    x = np.array([1.0, 2.5, -3.0], dtype=BFLOAT16)
    assert x.dtype.itemsize == 2 and st.dtype_name(x.dtype) == "bfloat16"
    assert (x.astype(np.float32) * 2).tolist() == [2.0, 5.0, -6.0]
    assert st.is_float_dtype(BFLOAT16)
    assert not np.issubdtype(BFLOAT16, np.floating)  # why is_float_dtype exists


@pytest.mark.parametrize("dtype, acc", [
    (np.float16, np.float32), (BFLOAT16, np.float32), (np.float32, np.float32),
    (np.float64, np.float64)])
def test_accumulation_dtype_is_float32_or_wider(dtype, acc):
    assert st.accumulate_dtype(dtype) == np.dtype(acc)
    assert st.accumulate_dtype(dtype, wide=True) == np.dtype(np.float64)


def test_integers_have_no_accumulation_dtype():
    with pytest.raises(StateError, match="only float arrays are summed"):
        st.accumulate_dtype(np.int32)


@pytest.mark.parametrize("dtype", st.SUPPORTED_DTYPES)
def test_every_supported_dtype_round_trips_through_its_name(dtype):
    assert st.dtype_from_name(st.dtype_name(dtype)) == dtype


def test_an_unknown_dtype_name_is_refused_listing_the_supported_ones():
    with pytest.raises(StateError, match="unsupported dtype 'complex64'; a state array may "
                                         "be one of: bfloat16, bool, float16"):
        st.dtype_from_name("complex64")


def test_a_valid_state_passes():
    validate_state({"w": np.ones((2, 3), np.float32), "b": np.zeros(3, BFLOAT16),
                    "steps": np.array(3), "meta": {"mu": 1.5, "tags": ["a", None, True]}})


@pytest.mark.parametrize("state, message", [
    ([1, 2], "state: expected a mapping of name -> array or JSON value, found list"),
    ({1: np.ones(1)}, "state: keys must be strings, found 1 (int)"),
    ({"": np.ones(1)}, "state: found an empty key"),
    ({"w": np.ones(2, np.complex64)}, "state 'w': arrays of dtype complex64 are not supported"),
    ({"w": np.array(["a"])}, "state 'w': arrays of dtype <U1 are not supported"),
    ({"w": np.array([1.0, np.nan])}, "state 'w': contains NaN or inf"),
    ({"w": np.array([np.inf], BFLOAT16)}, "state 'w': contains NaN or inf"),
    ({"m": {"lr": float("inf")}}, "state 'm'.lr: the JSON number inf is not finite"),
    ({"m": {"x": (1, 2)}}, "state 'm'.x: expected a numpy array or a JSON value"),
    ({"m": {3: 1}}, "state 'm': JSON object keys must be strings, found 3"),
    ({"m": [1, object()]}, "state 'm'[1]: expected a numpy array or a JSON value"),
])
def test_an_invalid_state_is_refused_naming_the_key(state, message):
    with pytest.raises(StateError) as err:
        validate_state(state)
    assert message in str(err.value)
    assert isinstance(err.value, meshkit.MeshError)


def test_non_finite_values_pass_when_allowed():
    validate_state({"w": np.array([np.nan]), "m": float("inf")}, allow_nonfinite=True)


def test_the_caller_chooses_the_error_and_the_label():
    with pytest.raises(meshkit.WireError, match="frame from rank 2: found an empty key"):
        validate_state({"": 1}, where="frame from rank 2", error=meshkit.WireError)


def test_json_classification():
    assert st.is_json_leaf(None) and st.is_json_leaf(True) and st.is_json_leaf("s")
    assert not st.is_json_leaf(np.float64(1.0)) and not st.is_json_leaf([1])
    assert st.is_json_value({"a": [1, {"b": None}]})
    assert not st.is_json_value({"a": (1,)}) and not st.is_json_value({1: 2})
    assert st.is_array(np.ones(1)) and st.is_array(np.float32(1)) and not st.is_array(1.0)


def test_copy_state_is_deep_and_keeps_dtypes():
    original = {"w": np.ones(2, BFLOAT16), "m": {"l": [1, 2]}}
    copy = st.copy_state(original)
    copy["w"][0] = 5
    copy["m"]["l"].append(3)
    assert original["w"].tolist() == [1, 1] and original["m"]["l"] == [1, 2]
    assert copy["w"].dtype == BFLOAT16


def test_json_numbers_are_listed_with_their_paths():
    found = list(st.iter_json_numbers({"a": [1, {"b": 2.5}], "c": True, "d": "x"}))
    assert found == [("a[0]", 1), ("a[1].b", 2.5)]


def test_state_nbytes_counts_arrays_only():
    assert st.state_nbytes({"w": np.ones(4, np.float32), "b": np.ones(2, BFLOAT16),
                            "m": 1.0}) == 20


# -- the JSON nesting bound, as the wire enforces it ------------------------------


def _nested(depth: int):
    """``depth`` lists inside each other around a 0."""
    return functools.reduce(lambda inner, _: [inner], range(depth), 0)


def test_the_wire_refuses_json_nested_past_the_bound():
    def body(state):
        return b"".join(bytes(b) for b in encode_state(state).buffers)

    assert decode_state(body({"meta": _nested(64)}))["meta"] == _nested(64)
    # A hostile peer encodes what a well-behaved one never would.
    with pytest.raises(WireError, match="'meta': JSON nested more than 64 levels"):
        decode_state(body({"meta": _nested(65)}))


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16, np.float32, np.float64])
def test_the_finiteness_scan_finds_every_nan_and_inf_chunk_by_chunk(dtype):
    chunk = st._SCAN_CHUNK
    for n in (0, 1, chunk - 1, chunk, chunk + 1, 3 * chunk + 5):
        clean = np.zeros(n, dtype=dtype)
        assert st.nonfinite_keys({"w": clean}) == []
        for where in sorted({0, n // 2, n - 1}) if n else []:
            for bad in (np.nan, np.inf, -np.inf):
                dirty = clean.copy()
                dirty[where] = bad
                assert st.nonfinite_keys({"a": clean, "w": dirty, "j": 1.0}) == ["w"], \
                    (n, where, bad)
    # Not contiguous, and in another memory order: the same answer.
    m = np.zeros((300, 400), dtype=dtype)
    m[299, 397] = np.inf
    assert not st._all_finite(m) and not st._all_finite(m.T)
    assert not st._all_finite(m[1::2, 1::3]) and st._all_finite(m[::2, ::2])


def test_the_finiteness_scan_allocates_a_chunk_not_the_array():
    import tracemalloc

    model = np.zeros(4 * st._SCAN_CHUNK * 16, dtype=np.float32)  # 4 MB, 1M bools whole
    tracemalloc.start()
    try:
        assert st.nonfinite_keys({"w": model}) == []
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < model.size // 4, peak  # a whole bool array would be model.size bytes


def test_update_keys_are_the_float_arrays_with_bfloat16_less_the_float_carried_counts():
    state = {"w": np.zeros(3, np.float32), "h": np.zeros(2, BFLOAT16),
             "half": np.zeros(2, np.float16), "bn.n": np.array(7.0),
             "steps": np.array(3, np.int64), "mask": np.ones(2, bool), "lr": 0.1,
             st.INT_BUFFERS: {"bn.n": "int64"}}
    assert st.update_keys(state) == ["h", "half", "w"]
    del state[st.INT_BUFFERS]  # without the leaf a float64 0-d array is a parameter
    assert st.update_keys(state) == ["bn.n", "h", "half", "w"]
