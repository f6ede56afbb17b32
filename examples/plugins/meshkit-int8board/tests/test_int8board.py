"""meshkit-int8board's tests: meshkit's board contract plus the datapath's arithmetic."""

from __future__ import annotations

import numpy as np
import pytest

import meshkit_int8board
from meshkit import ConfigError, MeshError
from meshkit.testing import BoardContract

OPTIONS = {"stage_id": "mlp.0", "input_elems": 16, "output_elems": 4, "scale": 0.05}


class TestInt8Board(BoardContract):
    component = "int8"
    options = OPTIONS
    plugins = [meshkit_int8board]  # test this source tree, whatever else is installed


class TestInt8BoardSquare(BoardContract):
    component = "int8"
    options = {"stage_id": "mlp.1", "input_elems": 32, "output_elems": 32,
               "scale": 0.01, "weight_seed": 7}
    plugins = [meshkit_int8board]


def _board(meshkit_plugins, **overrides):
    return meshkit_plugins(meshkit_int8board).create("board", "int8", {**OPTIONS, **overrides})


def test_the_output_is_the_fixed_point_product(meshkit_plugins):
    board = _board(meshkit_plugins)
    x = np.linspace(-1, 1, 16, dtype=np.float32)
    q = np.clip(np.rint(x / 0.05), -128, 127).astype(np.int64)
    w = board._device.weights.astype(np.int64)
    expected = (w @ q).astype(np.float32) * np.float32(0.05 / 64)
    np.testing.assert_array_equal(board.execute(x), expected)


def test_values_beyond_the_int8_range_saturate_and_are_counted(meshkit_plugins):
    board = _board(meshkit_plugins, scale=0.001)
    board.execute(np.full(16, 1.0, np.float32))  # 1.0 / 0.001 = 1000 > 127
    assert board.saturated == 16


def test_a_nan_activation_is_refused(meshkit_plugins):
    x = np.zeros(16, np.float32)
    x[3] = np.nan
    with pytest.raises(MeshError, match=r"stage \[mlp.0\].*NaN"):
        _board(meshkit_plugins).execute(x)


def test_a_non_positive_scale_is_a_config_error(meshkit_plugins):
    with pytest.raises(ConfigError, match=r"\[board\]"):
        _board(meshkit_plugins, scale=0.0)


def test_weights_load_from_an_int8_npy_file(meshkit_plugins, tmp_path):
    path = tmp_path / "eye.npy"
    np.save(path, np.eye(4, 16, dtype=np.int8))
    board = _board(meshkit_plugins, weights=str(path), weight_scale=1.0)
    x = np.arange(16, dtype=np.float32) * 0.05
    np.testing.assert_allclose(board.execute(x), x[:4], rtol=1e-6)


def test_weights_of_the_wrong_shape_are_a_config_error(meshkit_plugins, tmp_path):
    path = tmp_path / "w.npy"
    np.save(path, np.zeros((16, 4), dtype=np.int8))
    with pytest.raises(ConfigError, match=r"needs int8\[4, 16\]"):
        _board(meshkit_plugins, weights=str(path))
