"""meshkit.safetensors: a run's model as a safetensors file, written with numpy alone.

Read back three ways: the ``safetensors`` package's numpy and torch loaders
(when installed) and this module's own reader, which parses the header
itself, so the format is checked even where the package is missing.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshkit import StateError
from meshkit.checkpoint import Checkpoint, save_checkpoint
from meshkit.safetensors import export, read_safetensors, state_tensors, write_safetensors
from meshkit.state import BFLOAT16, INT_BUFFERS


def _state() -> dict:
    rng = np.random.default_rng(3)
    return {
        "w": rng.standard_normal((3, 4)).astype(np.float32),
        "b": rng.standard_normal(4),                          # float64
        "half": rng.standard_normal(5).astype(np.float16),
        "bf": rng.standard_normal((2, 3)).astype(BFLOAT16),
        "steps": np.arange(6, dtype=np.int64).reshape(2, 3),
        "small": np.array([1, 255], dtype=np.uint8),
        "mask": np.array([True, False, True]),
        "scalar": np.array(2.5, dtype=np.float32),  # 0-d
        "bn.num_batches_tracked": np.array(41.6),             # a torch count, carried as f64
        INT_BUFFERS: {"bn.num_batches_tracked": "int64"},
        "mu": 1.5,
        "filter": {"kind": "ema", "alpha": [0.1, 0.2]},
    }


@pytest.fixture
def run_dir(tmp_path):
    save_checkpoint(tmp_path, Checkpoint(round=4, state=_state()))
    return tmp_path


def _expected_arrays() -> dict[str, np.ndarray]:
    state = _state()
    arrays = {k: np.asarray(v) for k, v in state.items()
              if isinstance(v, (np.ndarray, np.generic))}
    arrays["bn.num_batches_tracked"] = np.array(42, dtype=np.int64)
    return arrays


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_the_file_reads_back_bit_for_bit_with_its_own_header(run_dir, tmp_path):
    file = export(run_dir, tmp_path / "model.safetensors")
    tensors, metadata = read_safetensors(file)
    expected = _expected_arrays()
    assert sorted(tensors) == sorted(expected)
    for key, array in expected.items():
        assert _same_bits(tensors[key], array), key
    assert metadata["meshkit.round"] == "4"
    assert json.loads(metadata["mu"]) == 1.5
    assert json.loads(metadata["filter"]) == {"kind": "ema", "alpha": [0.1, 0.2]}
    assert INT_BUFFERS not in metadata and INT_BUFFERS not in tensors


def test_the_header_is_the_documented_layout(run_dir, tmp_path):
    raw = export(run_dir, tmp_path / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    assert (8 + length) % 8 == 0  # data aligned
    header = json.loads(raw[8:8 + length])
    assert header["bf"] == {"dtype": "BF16", "shape": [2, 3],
                            "data_offsets": header["bf"]["data_offsets"]}
    assert header["scalar"]["shape"] == [] and header["mask"]["dtype"] == "BOOL"
    assert header["bn.num_batches_tracked"]["dtype"] == "I64"
    spans = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert spans[-1][1] == len(raw) - 8 - length


def test_safetensors_numpy_loads_the_run_state(run_dir, tmp_path):
    st_numpy = pytest.importorskip("safetensors.numpy")
    state = {k: v for k, v in _state().items() if k != "bf"}  # numpy has no bfloat16
    save_checkpoint(run_dir, Checkpoint(round=1, state=state))
    file = export(run_dir, tmp_path / "model.safetensors")
    loaded = st_numpy.load_file(str(file))
    expected = _expected_arrays()
    del expected["bf"]
    assert sorted(loaded) == sorted(expected)
    for key, array in expected.items():
        assert _same_bits(np.asarray(loaded[key]), array), key


def test_safetensors_torch_loads_bfloat16_and_integer_buffers(run_dir, tmp_path):
    pytest.importorskip("torch")
    st_torch = pytest.importorskip("safetensors.torch")
    import torch

    file = export(run_dir, tmp_path / "model.safetensors")
    loaded = st_torch.load_file(str(file))
    assert loaded["bf"].dtype == torch.bfloat16
    bf = _state()["bf"]
    assert loaded["bf"].view(torch.int16).numpy().tobytes() == bf.view(np.int16).tobytes()
    assert loaded["bn.num_batches_tracked"].dtype == torch.int64
    assert int(loaded["bn.num_batches_tracked"]) == 42
    assert loaded["w"].numpy().tobytes() == _state()["w"].tobytes()


def test_a_reserved_key_is_refused(tmp_path):
    with pytest.raises(StateError, match="__metadata__"):
        write_safetensors(tmp_path / "x.safetensors", {"__metadata__": np.zeros(1)})


def test_a_dtype_safetensors_cannot_name_is_refused_naming_the_key():
    with pytest.raises(StateError, match="'z'.*complex128"):
        state_tensors({"z": np.zeros(2, dtype=np.complex128)})


@pytest.mark.parametrize("damage", ["length", "offsets", "trailing"])
def test_a_damaged_file_is_refused_before_allocating(tmp_path, damage):
    file = write_safetensors(tmp_path / "x.safetensors", {"a": np.arange(4.0)})
    raw = bytearray(file.read_bytes())
    if damage == "length":
        raw[:8] = struct.pack("<Q", 2 ** 60)
    elif damage == "offsets":
        raw = raw.replace(b"[0,32]", b"[0,64]")
    else:
        raw += b"\0" * 8
    file.write_bytes(bytes(raw))
    with pytest.raises(StateError):
        read_safetensors(file)


# -- hostile headers: only ever StateError (issue 34) -----------------------------


def _file_with_header(tmp_path, header: bytes, data: bytes = b"") -> object:
    file = tmp_path / "hostile.safetensors"
    file.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return file


@pytest.mark.parametrize("header", [
    pytest.param(b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 1e999]}}',
                 id="infinite-offset"),                                      # OverflowError
    pytest.param(b'{"__metadata__": ["ab", "c"]}', id="metadata-a-list"),    # ValueError
    pytest.param(b'{"__metadata__": 5}', id="metadata-a-number"),            # TypeError
    pytest.param(b"[" * 100_000 + b"]" * 100_000, id="deep-nesting"),        # RecursionError
    pytest.param(b'{"a": {"dtype": "F32", "shape": [4294967296, 4294967296, 0], '
                 b'"data_offsets": [0, 0]}}', id="shape-wrapping-int64"),
    pytest.param(b'{"a": {"dtype": "F32", "shape": [1e999], "data_offsets": [0, 4]}}',
                 id="infinite-shape"),
    pytest.param(b'{"__metadata__": {"k": 5}}', id="metadata-not-strings"),
    pytest.param(b'{"a": {"dtype": "F32", "shape": [true], "data_offsets": [false, true]}}',
                 id="booleans-for-numbers"),
    pytest.param(b'{"a": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}',
                 id="dtype-a-list"),
])
def test_a_hostile_header_is_a_state_error(tmp_path, header):
    with pytest.raises(StateError):
        read_safetensors(_file_with_header(tmp_path, header, b"\0" * 4))


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20)
_ENTRY = st.fixed_dictionaries({
    "dtype": st.sampled_from(["F32", "F64", "BF16", "I8", "BOOL", "X9", ""]) | _JSON,
    "shape": st.lists(st.integers(-3, 2 ** 65) | _JSON, max_size=4) | _JSON,
    "data_offsets": st.lists(st.integers(-3, 2 ** 65) | _JSON, max_size=3) | _JSON,
})


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=st.dictionaries(st.text(max_size=4) | st.just("__metadata__"),
                              _ENTRY | _JSON, max_size=4),
       data=st.binary(max_size=64))
def test_any_header_is_read_or_refused_with_a_state_error(tmp_path, header, data):
    text = json.dumps(header).encode("utf-8")
    try:
        tensors, metadata = read_safetensors(_file_with_header(tmp_path, text, data))
    except StateError:
        return
    assert all(isinstance(v, str) for v in metadata.values())
    assert sum(t.nbytes for t in tensors.values()) == len(data)
