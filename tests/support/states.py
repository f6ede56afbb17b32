"""States that exercise every dtype and leaf the codec carries, and comparing them."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np


def every_dtype_state() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    state: dict[str, Any] = {
        "f32": rng.standard_normal((3, 4)).astype(np.float32),
        "f64": rng.standard_normal(5),
        "f16": rng.standard_normal((2, 2)).astype(np.float16),
        "bf16": rng.standard_normal(7).astype(ml_dtypes.bfloat16),
        "bool": np.array([[True, False, True]]),
        "scalar": np.array(2.5, dtype=np.float64),
        "empty": np.zeros((0, 3), dtype=np.int32),
        "strided": np.arange(20, dtype=np.int64)[::3],
        "big_endian": np.arange(4, dtype=">i4"),
        "json": {"lr": 0.1, "steps": [1, 2, 3], "name": "ünïcode", "none": None, "ok": True},
        "int": 7,
        "text": "hello",
        "nan": float("nan"),
    }
    for bits in (8, 16, 32, 64):
        state[f"i{bits}"] = np.array([-(2 ** (bits - 1)), 0, 2 ** (bits - 1) - 1],
                                     dtype=f"int{bits}")
        state[f"u{bits}"] = np.array([0, 1, 2 ** bits - 1], dtype=f"uint{bits}")
    return state


def assert_same_state(got: dict[str, Any], sent: dict[str, Any]) -> None:
    assert list(got) == list(sent)
    for key, value in sent.items():
        if isinstance(value, np.ndarray):
            assert got[key].dtype == value.dtype.newbyteorder("=") or got[key].dtype == value.dtype
            assert got[key].shape == value.shape
            np.testing.assert_array_equal(got[key], value)
        elif isinstance(value, float) and value != value:
            assert got[key] != got[key]
        else:
            assert got[key] == value
