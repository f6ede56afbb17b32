"""The body codec on its own (``meshkit.wire._codec``): no socket involved."""

from __future__ import annotations

import numpy as np
import pytest

from meshkit import wire
from meshkit.errors import WireError
from meshkit.wire import _codec

from tests.support.states import assert_same_state, every_dtype_state


# ----------------------------------------------------------------------------- roundtrips


def test_the_codec_roundtrips_without_a_socket():
    state = every_dtype_state()
    encoded = wire.encode_state(state)
    body = bytearray().join(memoryview(b).cast("B") for b in encoded.buffers)
    assert len(body) == encoded.nbytes
    assert_same_state(wire.decode_state(np.frombuffer(body, np.uint8)), state)


# ----------------------------------------------------------------------------- encoder refusals


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"c": np.zeros(2, np.complex64)}, "dtype complex64 is not a wire dtype"),
        ({"o": np.array([object()])}, "dtype object is not a wire dtype"),
        ({"s": np.float32(1.0)}, "numpy float32 scalar"),
        ({"f": {1, 2}}, "neither a numpy array nor a JSON value"),
        ({1: 2}, "state keys must be non-empty str"),
        ({"": 2}, "state keys must be non-empty str"),
        ({"t": (1, 2)}, "a tuple is not a JSON value"),
        ({"t": {"inner": [1, (2, 3)]}}, "a tuple is not a JSON value"),
        ({"d": {"x": {1: "a"}}}, "JSON object keys must be strings, found 1"),
    ],
)
def test_values_that_cannot_travel_are_refused_naming_the_key(state, message):
    with pytest.raises(WireError, match=message):
        wire.encode_state(state)


def test_oversized_counts_are_refused_by_the_encoder():
    with pytest.raises(WireError, match="at most 65536 entries"):
        wire.encode_state({str(i): i for i in range(wire.MAX_TENSORS + 1)})
    with pytest.raises(WireError, match="limit is 1024"):
        wire.encode_state({"n" * 1025: 1})
    with pytest.raises(WireError, match="limit is 32"):
        wire.encode_state({"x": np.zeros((1,) * 33)})


def test_a_json_object_with_non_string_keys_is_refused_not_silently_rekeyed() -> None:
    # json.dumps turns {1: "a"} into {"1": "a"}: the receiver got other keys
    # than were sent, and {1: "a", "1": "b"} arrived with one entry lost.
    for value in ({1: "a"}, {"ok": [{"1": "b", 1: "a"}]}, {None: 0}):
        with pytest.raises(WireError, match=r"'labels'.*keys must be strings"):
            wire.encode_state({"labels": value})
    state = wire.decode_state(b"".join(wire.encode_state({"labels": {"1": "a"}}).buffers))
    assert state == {"labels": {"1": "a"}}


@pytest.mark.parametrize(("entry", "message"), [
    ((3, 0, 0, 0, 1, 1), "entry 0: unknown entry kind 3 \\(expected 1 array or 2 JSON\\)"),
    # The first bound broken is the one named, in this order: kind, ndim, name, data.
    ((3, 0, 99, 0, 1 << 20, 1 << 40), "entry 0: unknown entry kind 3"),
    ((1, 7, 99, 0, 1 << 20, 1 << 40), "entry 0: 99 dimensions, the limit is"),
    ((2, 0, 0, 0, 1 << 20, 1 << 40), "entry 0: name of 1048576 bytes, the limit is"),
    ((2, 0, 0, 0, 1, 1 << 40), "entry 0: claims 1099511627776 bytes of data in a 256-byte body"),
])
def test_an_entry_out_of_bounds_is_refused_naming_the_bound(entry, message):
    body = _codec._BODY_HEAD.pack(1, 0) + _codec._ENTRY.pack(*entry)
    with pytest.raises(WireError, match=message):
        wire.decode_state(body + bytes(256 - len(body)))
