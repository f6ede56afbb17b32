"""A compressed contribution folded chunk by chunk (meshkit.compression.CompressedSum).

* the same bits as an exact sum (FixedPointSum) of the decoded contributions, whatever the
  order they come in, and the built-ins' ``decode_chunks`` (``rotate`` too, a block at a
  time) give ``decode``'s bits;
* a refused contribution (NaN, out of range, a payload that does not fit) leaves the sum
  as it was, though some of its chunks were already added;
* folding a quantised contribution, rotated or not, allocates far less than one float copy
  of the model.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import meshkit
from meshkit.aggregation import ContributionOutOfRange, FixedPointSum
from meshkit.compression import (SEP, CompressedSum, decode_contribution, decoded_chunks,
                                 encode_update)
from meshkit.errors import AggregationError, ProtocolError


def _compressor(name, **options):
    return meshkit.plugins.create("compression", name, options)


def _model(rng, sizes=(5000, 130, 1)):
    state = {f"w{i}": rng.standard_normal(n).astype(np.float32) for i, n in enumerate(sizes)}
    state["b"] = rng.standard_normal((3, 7))  # float64
    state["count"] = np.arange(4, dtype=np.int64)
    return state


def _payloads(compressor, start, n, rng):
    out = []
    for i in range(n):
        fitted = {k: (v + rng.standard_normal(v.shape).astype(v.dtype) * 0.1
                      if v.dtype.kind == "f" else v) for k, v in start.items()}
        payload, _ = encode_update(compressor, start, fitted, seed=i, raw=["count"])
        out.append(payload)
    return out


@pytest.mark.parametrize("name, options", [
    ("quantize", {"bits": 8}), ("quantize", {"bits": 4}), ("quantize", {"bits": 2}),
    ("quantize", {"bits": 2, "chunk": 100}),
    ("top-k", {"fraction": 0.05, "error_feedback": False}),
    ("quantize", {"bits": 8, "rotate": True}),
    ("top-k", {"fraction": 0.05, "error_feedback": False, "rotate": True}),
    ("top-k", {"fraction": 0.05, "index": "gap8", "value_bits": 8}),
    ("top-k", {"fraction": 0.002, "index": "gap8", "value_bits": 4, "error_feedback": False}),
    ("top-k", {"fraction": 0.05, "index": "u32", "value_bits": 4}),
])
def test_the_chunked_fold_is_the_exact_sum_of_the_decoded_contributions(name, options):
    rng = np.random.default_rng(3)
    compressor = _compressor(name, **options)
    start = _model(rng)
    payloads = _payloads(compressor, start, 5, rng)
    weights = [3.0, 1.0, 17.0, 2.5, 8.0]
    exact = FixedPointSum()
    for i, (p, w) in enumerate(zip(payloads, weights)):
        state, _ = decode_contribution(compressor, p, start, raw=["count"])
        exact.add(state, w, source=f"c{i}")
    want = exact.result()
    for order in ([0, 1, 2, 3, 4], [4, 2, 0, 3, 1]):
        folded = CompressedSum(compressor, start, raw=["count"], step=777)
        for i in order:
            folded.add(payloads[i], weights[i], source=f"c{i}")
        got = folded.result()
        assert list(got) == list(want)
        for key in want:
            assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape
            assert got[key].tobytes() == want[key].tobytes(), (key, order)


@pytest.mark.parametrize("name, options", [
    ("quantize", {"bits": 8}), ("quantize", {"bits": 4}), ("quantize", {"bits": 2}),
    ("top-k", {"fraction": 0.01}), ("quantize", {"bits": 8, "rotate": True}),
    ("quantize", {"bits": 4, "rotate": True, "chunk": 64}),
    ("top-k", {"fraction": 0.01, "rotate": True}),
    ("top-k", {"fraction": 0.06, "index": "gap8", "value_bits": 8}),
    ("top-k", {"fraction": 0.001, "index": "gap8", "value_bits": 32})])
@pytest.mark.parametrize("step", [1, 3, 1000, 4096, 5000, 1 << 16])
def test_decode_chunks_gives_decodes_bits(name, options, step):
    compressor = _compressor(name, **options)
    x = np.random.default_rng(0).standard_normal(2049).astype(np.float32)
    fields = compressor.encode(x, seed=1)
    whole = compressor.decode(fields, x.size)
    parts = list(decoded_chunks(compressor, fields, x.size, "k", step))
    assert [s for s, _ in parts] == list(range(0, x.size, step))
    assert np.concatenate([p for _, p in parts]).tobytes() == whole.tobytes()


def test_a_refused_contribution_leaves_the_sum_as_it_was():
    rng = np.random.default_rng(5)
    compressor = _compressor("quantize", bits=8)
    start = _model(rng, sizes=(4000,))
    good = _payloads(compressor, start, 3, rng)
    lo = f"w0{SEP}lo"
    nan = {**good[1], lo: good[1][lo].copy()}
    nan[lo][-1] = np.inf  # the last chunk's scale: every chunk before it is added first
    huge = {**good[1], lo: good[1][lo].copy()}
    huge[lo][-1] = 3e38
    short = {k: v for k, v in good[1].items() if k != f"w0{SEP}step"}
    clean = CompressedSum(compressor, start, raw=["count"], step=512)
    clean.add(good[0], 2.0, source="a")
    clean.add(good[2], 1.0, source="c")
    want = clean.result()
    folded = CompressedSum(compressor, start, raw=["count"], step=512)
    folded.add(good[0], 2.0, source="a")
    with pytest.raises(ProtocolError, match="does not decode"):
        folded.add(nan, 1.0, source="bad")  # the compressor's own check of its scales
    with pytest.raises(ContributionOutOfRange):
        folded.add(huge, 1e9, source="huge")
    with pytest.raises(ProtocolError, match="step"):
        folded.add(short, 1.0, source="short")
    bad_count = {**good[1], "count": np.arange(4, dtype=np.int64) + 1}
    with pytest.raises(AggregationError):  # the whole keys refuse after w0 was added
        folded.add(bad_count, 1.0, source="count")
    folded.add(good[2], 1.0, source="c")
    assert folded.count == 2
    got = folded.result()
    for key in want:
        assert got[key].tobytes() == want[key].tobytes(), key


@pytest.mark.parametrize("options", [{"bits": 8}, {"bits": 8, "rotate": True}])
def test_folding_a_quantised_contribution_allocates_far_less_than_a_float_copy(options):
    rng = np.random.default_rng(0)
    size = 1 << 22  # 4 Mi float32 coordinates: 16 MiB a copy
    start = {"w": rng.standard_normal(size).astype(np.float32)}
    compressor = _compressor("quantize", **options)
    fitted = {"w": start["w"] + np.float32(0.01)}
    payload, _ = encode_update(compressor, start, fitted, seed=0)
    del fitted
    folded = CompressedSum(compressor, start)  # its int64 accumulator is allocated here
    folded.add(payload, 1.0, source="warm-up")
    copy = start["w"].nbytes
    tracemalloc.start()
    try:
        folded.add(payload, 2.0, source="measured")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Decoding it whole (decode_contribution) makes a float32 update and a float64 model:
    # three float32 copies and more. The chunked fold's scratch is a chunk's.
    assert peak < copy / 8, (peak, copy)
    tracemalloc.start()
    try:
        decode_contribution(compressor, payload, start)
        _, whole = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert whole > copy  # what the test would see if the fold decoded whole
