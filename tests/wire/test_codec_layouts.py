"""Tables decoded before skip their walk, and decode exactly as a cold decode would.

``decode_state`` keeps each table it accepted whole (``_codec._LAYOUTS``): a
later body with the same table bytes and size reads its data at the cached
offsets. These tests hold the cache to its promise: whatever a body holds
(hostile data, a table one byte off, another size, unknown flags), the warm
decode returns the same state or raises the same error as a decode with the
cache empty. ``encode_state`` keeps the UTF-8 bytes of the keys it checked
(``_codec._NAMES``): a bad key is still refused, a str subclass never cached.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshkit import wire
from meshkit.errors import WireError
from meshkit.wire import _codec

FUZZ = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])

REQUEST = {"op": "fit", "seq": 12, "round": 7, "keep": True, "metrics": {"loss": [0.5, 1]},
           "w": np.arange(12, dtype=np.float64).reshape(3, 4), "b": np.ones(4, np.float32),
           "mask": np.array([True, False, True]), "n": np.array(3, dtype=np.int64)}


def _body(state: dict, bf16: bool = False) -> bytes:
    return bytes(bytearray().join(memoryview(b).cast("B")
                                  for b in wire.encode_state(state, bf16=bf16).buffers))


def _outcome(body: bytes, flags: int = 0) -> object:
    try:
        state = wire.decode_state(np.frombuffer(bytearray(body), dtype=np.uint8), flags=flags)
    except WireError as exc:
        return ("WireError", str(exc))
    return [(k, (v.dtype.str, v.shape, v.tobytes()) if isinstance(v, np.ndarray) else repr(v))
            for k, v in state.items()]


def _cold(body: bytes, flags: int = 0) -> object:
    _codec._LAYOUTS.clear()
    _codec._TABLE_LENGTHS.clear()
    return _outcome(body, flags)


@pytest.fixture
def laid_out(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the decodes that took a cached layout."""
    calls: list[int] = []
    real = _codec._decode_laid_out

    def spy(*args: object) -> dict:
        calls.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(_codec, "_decode_laid_out", spy)
    return calls


def test_a_repeated_table_is_read_from_the_cache(laid_out: list[int]) -> None:
    body = _body(REQUEST)
    first = _cold(body)
    assert not laid_out
    assert _outcome(body) == first
    assert laid_out == [1]
    # Another round's values, same table: still the cached layout, the new values.
    again = dict(REQUEST, seq=13, w=REQUEST["w"] + 1)
    assert _outcome(_body(again)) == _cold(_body(again))
    assert _outcome(_body(again)) == _cold(_body(again))
    assert len(laid_out) == 3


def test_a_json_value_of_another_length_is_another_table(laid_out: list[int]) -> None:
    _cold(_body(REQUEST))
    longer = dict(REQUEST, seq=1234567)
    assert _outcome(_body(longer)) == _cold(_body(longer))
    assert not laid_out  # the table says another data length: walked, not looked up


@FUZZ
@given(bf16=st.booleans(), flags=st.integers(0, 3),
       edits=st.lists(st.tuples(st.integers(0, 700), st.integers(0, 255)), min_size=1,
                      max_size=3),
       cut=st.integers(-70, 70))
def test_a_hostile_body_decodes_warm_as_it_does_cold(bf16: bool, flags: int,
                                                     edits: list[tuple[int, int]],
                                                     cut: int) -> None:
    clean = _body(REQUEST, bf16=bf16)
    body = bytearray(clean)
    for at, value in edits:
        if at < len(body):
            body[at] = value
    body = body[:len(body) + cut] if cut < 0 else body + bytes(cut)
    expected = _cold(bytes(body), flags)
    _outcome(clean)  # the clean table in the cache
    _outcome(bytes(body), flags)  # and the hostile one's, if it was accepted
    assert _outcome(bytes(body), flags) == expected


def test_bad_data_behind_a_cached_table_is_refused() -> None:
    body = bytearray(_body(REQUEST))
    _cold(bytes(body))
    mask = REQUEST["mask"].tobytes()
    at = bytes(body).index(mask + bytes(64 - len(mask)))  # the bool array's data
    body[at] = 2
    assert _outcome(bytes(body)) == ("WireError",
                                     "entry 'mask': a bool array holds bytes other than 0 and 1")
    body = bytearray(_body(REQUEST))
    at = bytes(body).index(b'"fit"')
    body[at + 1:at + 4] = b"\xff\xfe{"
    assert _outcome(bytes(body))[0] == "WireError"
    assert _outcome(bytes(body)) == _cold(bytes(body))


def test_the_cache_is_bounded() -> None:
    _codec._LAYOUTS.clear()
    for i in range(3 * _codec._LAYOUTS_MAX):
        wire.decode_state(_body({f"key{i}": i, "x": np.zeros(i % 7)}))
        assert len(_codec._LAYOUTS) <= _codec._LAYOUTS_MAX
        assert len(_codec._TABLE_LENGTHS) <= _codec._LAYOUTS_MAX
    # A model's table of a thousand entries is kept; the bytes kept stay bounded.
    for i in range(60):
        model = {f"run{i}/block{j}/weight": np.zeros(2, np.float32) for j in range(1000)}
        wire.decode_state(_body(model))
        assert sum(map(len, _codec._LAYOUTS)) <= _codec._LAYOUT_BYTES_MAX
        assert len(_codec._LAYOUTS[bytes(_body(model)[:_codec._TABLE_LENGTHS[1000]])][1]) == 1000
    assert len(_codec._NAMES) <= _codec._NAMES_MAX


def test_threads_decode_their_own_tables_at_once() -> None:
    bodies = [_body({f"t{k}": k, "seq": k, "x": np.full(k + 1, k, np.float32)}) for k in range(4)]
    expected = [_cold(b) for b in bodies]
    wrong: list[object] = []
    start = threading.Barrier(4)

    def decode(k: int) -> None:
        start.wait()
        for _ in range(300):
            got = _outcome(bodies[k])
            if got != expected[k]:
                wrong.append(got)

    threads = [threading.Thread(target=decode, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    assert not wrong


def test_encoded_names_are_checked_once_and_bounded() -> None:
    with pytest.raises(WireError, match="non-empty str"):
        wire.encode_state({"": 1, "a": 2})
    with pytest.raises(WireError, match="non-empty str"):
        wire.encode_state({1: 1, "a": 2})  # type: ignore[dict-item]
    with pytest.raises(WireError, match="bytes of UTF-8"):
        wire.encode_state({"x" * (_codec.MAX_NAME_BYTES + 1): 1, "a": 2})

    class Name(str):
        pass

    # A str subclass is checked each time and never cached (its encode may differ).
    _codec._NAMES.clear()
    assert wire.decode_state(_body({Name("sub"): 1, "a": 2})) == {"sub": 1, "a": 2}
    assert "sub" not in _codec._NAMES and "a" in _codec._NAMES
    for i in range(_codec._NAMES_MAX + 10):
        wire.encode_state({f"n{i}": i, "a": 2})
    assert len(_codec._NAMES) <= _codec._NAMES_MAX
