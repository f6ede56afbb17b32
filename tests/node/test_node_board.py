"""Boards (``meshkit/node/board.py``): the descriptor, the loopback driver, the deadline."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from meshkit import (
    BoardError,
    BoardTimeoutError,
    ConfigError,
    FixedFunction,
    PlacementError,
    plugins,
)
from meshkit.node.board import DeadlineBoard, open_board
from meshkit.pipeline import Stage

RELEASE = threading.Event()


def hang(x: np.ndarray) -> np.ndarray:
    """A datapath that stops clocking until the test releases it."""
    RELEASE.wait(30)
    return x


def broken(x: np.ndarray) -> np.ndarray:
    raise RuntimeError("DMA transfer failed")


def halve_length(x: np.ndarray) -> np.ndarray:
    return x[: x.size // 2]


def test_loopback_is_offered_by_the_boards_plugin():
    component = plugins.available("board")["loopback"]
    assert component.provenance.plugin == "boards"
    assert "fixed-function" in component.summary


def test_identity_and_scale():
    with open_board("loopback", {"stage_id": "s", "input_elems": 4, "output_elems": 4}) as b:
        assert b.descriptor == FixedFunction("s", 4, 4, "float32")
        x = np.arange(4, dtype=np.float32)
        y = b.execute(x)
        assert np.array_equal(y, x) and y is not x and y.dtype == np.float32
    with open_board("loopback", {"stage_id": "s", "input_elems": 3, "output_elems": 3,
                                 "function": "scale", "scale": -2.0}) as b:
        assert np.array_equal(b.execute(np.array([1, 2, 3], np.float32)), [-2, -4, -6])


def test_affine_loads_its_weights_and_bias_from_npy(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((5, 3)).astype(np.float32)
    bias = rng.standard_normal(3).astype(np.float32)
    np.save(tmp_path / "w.npy", w)
    np.save(tmp_path / "b.npy", bias)
    board = open_board("loopback", {
        "stage_id": "fc", "input_elems": 5, "output_elems": 3, "function": "affine",
        "weights": str(tmp_path / "w.npy"), "bias": str(tmp_path / "b.npy")})
    x = rng.standard_normal(5).astype(np.float32)
    np.testing.assert_array_equal(board.execute(x), x @ w + bias)
    board.close()


def test_affine_weights_of_the_wrong_shape_are_refused(tmp_path):
    np.save(tmp_path / "w.npy", np.zeros((3, 5), np.float32))
    with pytest.raises(ConfigError) as err:
        open_board("loopback", {"stage_id": "fc", "input_elems": 5, "output_elems": 3,
                                "function": "affine", "weights": str(tmp_path / "w.npy")})
    assert "has shape (3, 5), expected (5, 3)" in str(err.value)
    with pytest.raises(ConfigError, match=r"function 'affine' needs weights = a \.npy file"):
        open_board("loopback", {"stage_id": "fc", "input_elems": 5, "output_elems": 3,
                                "function": "affine"})


def test_identity_cannot_change_the_length_and_unknown_functions_are_refused():
    with pytest.raises(ConfigError, match="input_elems=4 and output_elems=2"):
        open_board("loopback", {"stage_id": "s", "input_elems": 4, "output_elems": 2})
    with pytest.raises(ConfigError, match="function must be 'identity', 'scale', 'affine'"):
        open_board("loopback", {"stage_id": "s", "input_elems": 4, "output_elems": 4,
                                "function": "softmax"})
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module_xyz'"):
        open_board("loopback", {"stage_id": "s", "input_elems": 4, "output_elems": 4,
                                "function": "no_such_module_xyz:f"})


def test_a_module_function_board_runs_the_function():
    board = open_board("loopback", {"stage_id": "s", "input_elems": 6, "output_elems": 3,
                                    "function": f"{__name__}:halve_length"})
    assert board.execute(np.arange(6, dtype=np.float32)).tolist() == [0, 1, 2]


def test_the_datapath_dtype_is_emulated():
    board = open_board("loopback", {"stage_id": "q", "input_elems": 4, "output_elems": 4,
                                    "dtype": "int8", "function": "scale", "scale": 100.0})
    y = board.execute(np.array([0.4, 1.6, -3.0, 2.0], np.float32))
    # inputs round to integers, outputs saturate at the int8 range
    assert y.tolist() == [0.0, 127.0, -128.0, 127.0] and y.dtype == np.float32
    half = open_board("loopback", {"stage_id": "h", "input_elems": 1, "output_elems": 1,
                                   "dtype": "bfloat16"})
    assert half.execute(np.array([1.00390625], np.float32)).tolist() == [1.0]


def test_the_loopback_driver_refuses_a_wrong_input_length():
    board = open_board("loopback", {"stage_id": "s", "input_elems": 4, "output_elems": 4})
    with pytest.raises(BoardError) as err:
        board.execute(np.zeros(5, np.float32))
    assert "stage [s] takes 4 elements, got 5" in str(err.value)


def test_a_hung_board_is_an_error_naming_the_stage_and_the_deadline_not_a_hang():
    RELEASE.clear()
    board = open_board("loopback", {"stage_id": "slow", "input_elems": 2, "output_elems": 2,
                                    "function": f"{__name__}:hang", "deadline": 0.2})
    try:
        with pytest.raises(BoardTimeoutError) as err:
            board.execute(np.zeros(2, np.float32))
        assert "board for stage [slow] did not answer within its deadline of 0.2 s" \
            in str(err.value)
        # The stuck call still owns the device: later calls are refused, not queued.
        with pytest.raises(BoardError, match=r"stage \[slow\] is wedged"):
            board.execute(np.zeros(2, np.float32))
    finally:
        RELEASE.set()
        board.close()


def test_a_board_that_raises_is_a_board_error_naming_the_stage():
    board = open_board("loopback", {"stage_id": "dma", "input_elems": 2, "output_elems": 2,
                                    "function": f"{__name__}:broken"})
    with pytest.raises(BoardError) as err:
        board.execute(np.zeros(2, np.float32))
    assert str(err.value) == "board for stage [dma] failed: RuntimeError: DMA transfer failed"
    board.close()


def test_a_driver_without_a_descriptor_is_refused():
    class NoDescriptor:
        def execute(self, x):
            return x

    with pytest.raises(BoardError, match="must expose `descriptor` as a meshkit.FixedFunction"):
        DeadlineBoard(NoDescriptor())


def test_unknown_board_options_are_config_errors():
    with pytest.raises(ConfigError, match="colour: unknown key"):
        open_board("loopback", {"stage_id": "s", "input_elems": 2, "output_elems": 2,
                                "colour": "red"})


FF = FixedFunction("enc0", 16, 8)


def test_fixed_function_accepts_only_its_own_stage_and_names_both_ids():
    assert FF.accepts(Stage.board("enc0"))
    assert not FF.accepts(Stage.board("dec1"))
    with pytest.raises(PlacementError) as err:
        FF.check(Stage.board("dec1"))
    assert str(err.value) == (
        "fixed-function rank implements stage [enc0], cannot run [dec1]: an FPGA "
        "datapath is synthesized, not compiled")


def return_nothing(x: np.ndarray) -> None:
    """A stage function that forgot its return statement."""


def test_a_loopback_function_returning_none_is_a_board_error():
    board = open_board("loopback", {"stage_id": "s", "input_elems": 2, "output_elems": 1,
                                    "function": f"{__name__}:return_nothing"})
    with pytest.raises(BoardError, match="expected numbers"):
        board.execute(np.zeros(2, np.float32))
    board.close()


@pytest.mark.parametrize("deadline", [float("inf"), 1e300])
def test_a_deadline_too_large_to_wait_on_is_refused_up_front(deadline):
    with pytest.raises(BoardError, match="board deadline must be"):
        open_board("loopback", {"stage_id": "s", "input_elems": 2, "output_elems": 2,
                                "deadline": deadline})


def test_weights_that_are_not_one_numeric_npy_array_are_config_errors(tmp_path):
    npz = tmp_path / "w.npz"
    np.savez(npz, w=np.ones((2, 2)))
    text = tmp_path / "s.npy"
    np.save(text, np.array([["a", "b"], ["c", "d"]]))
    cplx = tmp_path / "c.npy"
    np.save(cplx, np.ones((2, 2), complex))
    for path, found in ((npz, "an .npz archive"), (text, "dtype <U1"),
                        (cplx, "dtype complex128")):
        with pytest.raises(ConfigError) as err:
            open_board("loopback", {"stage_id": "s", "input_elems": 2, "output_elems": 2,
                                    "function": "affine", "weights": str(path)})
        assert str(err.value).startswith(f"[board] weights: {str(path)!r}")
        assert found in str(err.value)
