"""The one-array fast paths of encode_state/decode_state agree with the general path.

Every pipeline activation frame is one array (``{"act/<job>/<seq>": rows}``);
``_encode_one_array`` and ``_decode_one_array`` handle it without the
general loop. They must produce the same bytes and the same state, and
anything hostile they are handed must end as the general path ends it: the
same state or a ``WireError``.
"""

from __future__ import annotations

import json
import re
import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshkit import wire
from meshkit.errors import WireError
from meshkit.wire import _codec

FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


def _joined(encoded: wire.EncodedState) -> bytes:
    return bytes(bytearray().join(memoryview(b).cast("B") for b in encoded.buffers))


def _general_encode(state: dict, bf16: bool = False) -> bytes:
    original = _codec._encode_one_array
    _codec._encode_one_array = lambda state, bf16: None
    try:
        return _joined(wire.encode_state(state, bf16=bf16))
    finally:
        _codec._encode_one_array = original


def _outcome(data: bytes, flags: int = 0, *, general: bool = False) -> object:
    original = _codec._decode_one_array
    if general:
        _codec._decode_one_array = lambda buf, mv, size: None
    try:
        state = wire.decode_state(np.frombuffer(bytearray(data), dtype=np.uint8), flags=flags)
    except WireError:
        return WireError
    finally:
        _codec._decode_one_array = original
    return {k: (v.dtype, v.shape, v.tobytes()) if isinstance(v, np.ndarray) else v
            for k, v in state.items()}


ARRAYS = [
    np.zeros((1, 256), np.float32),
    np.arange(24, dtype=np.float64).reshape(2, 3, 4),
    np.array(7, dtype=np.int32),  # 0-d
    np.zeros((0, 5), np.uint8),
    np.ones(3, ml_dtypes.bfloat16),
    np.arange(6, dtype=">i4"),  # big-endian: the general path converts it
    np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2],  # not contiguous
    np.array([True, False]),
]


@pytest.mark.parametrize("array", ARRAYS, ids=lambda a: f"{a.dtype}{a.shape}")
@pytest.mark.parametrize("bf16", [False, True])
def test_one_array_encodes_to_the_general_paths_bytes_and_decodes_alike(array, bf16):
    state = {"act/3/41": array}
    fast = _joined(wire.encode_state(state, bf16=bf16))
    assert fast == _general_encode(state, bf16)
    flags = wire.FLAG_BF16 if bf16 else 0
    assert _outcome(fast, flags) == _outcome(fast, flags, general=True)
    decoded = wire.decode_state(np.frombuffer(bytearray(fast), dtype=np.uint8), flags=flags)
    expected = array
    if bf16 and array.dtype == np.float32:  # narrowed on the wire, widened back
        expected = array.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(decoded["act/3/41"], expected)


def test_a_decoded_activation_is_a_writable_view_of_the_body():
    body = np.frombuffer(bytearray(_joined(wire.encode_state({"x": np.ones((1, 4), np.float32)}))),
                         dtype=np.uint8)
    x = wire.decode_state(body)["x"]
    assert x.flags.writeable and np.shares_memory(x, body)


SAMPLE = _joined(wire.encode_state({"act/1/2": np.arange(40, dtype=np.float32).reshape(2, 20)}))


@FUZZ
@given(pos=st.integers(0, len(SAMPLE) - 1), value=st.integers(0, 255),
       cut=st.integers(0, len(SAMPLE)), flags=st.sampled_from([0, 1, 2, 0x80]))
def test_hostile_one_array_bodies_end_as_the_general_path_ends_them(pos, value, cut, flags):
    data = bytearray(SAMPLE)
    data[pos] = value
    data = bytes(data[:cut]) if cut < len(data) // 2 else bytes(data)
    assert _outcome(data, flags) == _outcome(data, flags, general=True)


@FUZZ
@given(code=st.integers(0, 255), ndim=st.integers(0, 40), eflags=st.integers(0, 3),
       name_len=st.integers(0, 2048), data_len=st.integers(0, 2 ** 64 - 1),
       dims=st.lists(st.integers(0, 2 ** 64 - 1), max_size=6), tail=st.binary(max_size=200))
def test_hostile_one_array_tables_are_refused_or_decoded_as_before(code, ndim, eflags, name_len,
                                                                  data_len, dims, tail):
    data = (struct.pack("<IIBBBBIQ", 1, 0, 1, code, ndim, eflags, name_len, data_len)
            + b"".join(struct.pack("<Q", d) for d in dims) + tail)
    assert _outcome(data) == _outcome(data, general=True)


class _Str(str):
    pass


class _Int(int):
    pass


SCALARS = ["fit", "é\u2028\"\\\n\x00", "", 0, -5, 2**70, True, False, None, 1.5, -0.0, 1e300,
           5e-324, float("nan"), float("inf"), -float("inf"), _Str("x"), _Int(3)]


@pytest.mark.parametrize("value", SCALARS, ids=repr)
def test_a_scalar_json_entry_is_the_bytes_the_json_encoder_writes(value):
    # encode_state writes exact str/int/bool/None/finite float entries without the
    # encoder (issue 36): the bytes must be the encoder's, and decode back the same.
    body = _joined(wire.encode_state({"w": np.ones(3, np.float32), "k": value}))
    text = _codec._JSON_ENCODER.encode(value).encode("utf-8")
    assert body.endswith(text)
    # The entry's recorded length is the text's: the table ends where the names do.
    assert struct.pack("<BBBBIQ", _codec.ENTRY_JSON, 0, 0, 0, 1, len(text)) + b"k" in body
    back = wire.decode_state(body)["k"]
    assert back == value or (value != value and back != back)


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(), inner, max_size=3), max_leaves=8))
@FUZZ
def test_any_json_entry_is_the_bytes_the_json_encoder_writes(value):
    body = _joined(wire.encode_state({"k": value, "w": np.zeros(2, np.float64)}))
    text = _codec._JSON_ENCODER.encode(value).encode("utf-8")
    assert text in body


_JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                            lambda inner: st.lists(inner, max_size=3)
                            | st.dictionaries(st.text(), inner, max_size=3), max_leaves=8)


@given(_JSON_VALUES, st.sampled_from(["", " ", "\n\t ", "\r"]),
       st.sampled_from(["", " ", "\n", "x", ",", "]", "}", "\x00"]))
@FUZZ
def test_a_json_entry_reads_as_json_loads_reads_it(value, before, after):
    # decode_state reads a JSON entry with json's C scanner and hands anything it does
    # not take whole to json.loads (issue 36): the value, or the refusal, is json.loads'.
    raw = (before + _codec._JSON_ENCODER.encode(value) + after).encode("utf-8")
    try:
        expected = json.loads(raw.decode("utf-8"))
    except ValueError as exc:
        with pytest.raises(type(exc)):
            _codec._json_value(raw)
        return
    got = _codec._json_value(raw)
    assert json.dumps(got, allow_nan=True) == json.dumps(expected, allow_nan=True)


@pytest.mark.parametrize("raw", [b"", b"{", b"[1,]", b"5x", b"\xff", b"'s'", b"[" * 10, b"0123"])
def test_text_that_is_not_json_is_refused_as_json_loads_refuses_it(raw):
    with pytest.raises(ValueError) as exc:
        _codec._json_value(raw)
    with pytest.raises(type(exc.value), match=re.escape(str(exc.value))):
        json.loads(raw.decode("utf-8"))


def test_a_requests_scalar_fields_are_read_without_json_loads(monkeypatch):
    request = {"op": "fit", "seq": 12, "keep": True, "lr": 0.01, "shard": None, "tag": "é",
               "metrics": {"loss": 0.5}, "w": np.ones(3, np.float32)}
    body = _joined(wire.encode_state(request))

    def refuse(*args, **kwargs):
        raise AssertionError("json.loads was called for a value json's scanner reads whole")

    monkeypatch.setattr(_codec.json, "loads", refuse)
    state = wire.decode_state(body)
    assert {k: v for k, v in state.items() if k != "w"} == {
        k: v for k, v in request.items() if k != "w"}
