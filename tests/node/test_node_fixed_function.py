"""A board rank serving its pipeline jobs: the board's edges are checked, never trusted.

The board must implement the stage the rank advertises and the stage it is
shipped; every activation's length in, and the board's output length and
numbers out, are checked against its descriptor (``meshkit/node/board.py``),
and a refusal leaves the node serving.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from tests.support.inproc_mesh import JOBS, loopback, reply

from meshkit import BoardError, FixedFunction, PlacementError
from meshkit.node import (
    TAG_ACT,
    TAG_UP,
    DeadlineBoard,
    local_caps,
    send_job,
    serve_fixed_function,
    serve_node,
)
from meshkit.pipeline import Stage, run_local, run_pipeline


class WrongOutputBoard:
    """A driver whose datapath disagrees with its own descriptor."""

    descriptor = FixedFunction("mid", 8, 8)

    def execute(self, x: np.ndarray) -> np.ndarray:
        return x[:4].copy()


def test_an_activation_of_the_wrong_length_into_a_board_is_refused_naming_both_sizes(
        mesh_factory):
    mesh = mesh_factory({1: {"board": loopback()}, 2: {}})
    stages = [Stage.board("mid"), Stage(op="identity")]
    with pytest.raises(PlacementError) as err:
        # in_flight 8 packs two activations a frame: the short one travels alone.
        run_pipeline(mesh.g0, stages, mesh.caps, [np.zeros(8), np.zeros(5), np.zeros(8)],
                     in_flight=8)
    assert str(err.value) == (
        "rank 1: fixed-function stage [mid] takes 8 elements, got an activation of 5: the "
        "datapath is synthesized for one shape and cannot adapt; fix the stage feeding it")
    # The pipeline unwound: both ranks reported and serve the next job.
    ok = run_pipeline(mesh.g0, stages, mesh.caps, [np.ones(8)])
    np.testing.assert_array_equal(ok.outputs[0], np.ones(8, np.float32))


def test_a_board_returning_the_wrong_length_is_refused_naming_both_sizes(mesh_factory):
    mesh = mesh_factory({1: {"board": DeadlineBoard(WrongOutputBoard())}})
    with pytest.raises(PlacementError) as err:
        run_pipeline(mesh.g0, [Stage.board("mid")], mesh.caps, [np.zeros(8)])
    assert str(err.value) == (
        "rank 1: fixed-function stage [mid] declares 8 output elements, but the board "
        "returned 4: the board and its descriptor disagree; fix the board driver or its "
        "descriptor")


def test_a_board_whose_stage_differs_from_the_advertised_one_is_refused():
    advertised = local_caps(1, fixed_function=FixedFunction("enc0", 8, 8))
    with pytest.raises(PlacementError) as err:
        serve_node(object(), advertised, jobs=JOBS, board=loopback("dec1"))
    assert str(err.value) == (
        "the board implements stage [dec1] (8 -> 8 float32) but this rank advertises stage "
        "[enc0] (8 -> 8 float32): fix the board options or the advertised descriptor so "
        "they agree")
    with pytest.raises(PlacementError, match=r"implements stage \[enc0\] \(8 -> 4"):
        serve_fixed_function(object(),
                             loopback("enc0", 8, 4, function=f"{__name__}:half"),
                             advertised=FixedFunction("enc0", 8, 8))


def half(x: np.ndarray) -> np.ndarray:
    return x[:4]


def test_a_board_rank_refuses_a_stage_it_does_not_implement_before_activations_move(
        mesh_factory):
    mesh = mesh_factory({1: {"board": loopback("enc0")}, 2: {}})
    # Bypass the coordinator's placement (explicit ranks are still checked)...
    with pytest.raises(PlacementError, match=r"implements stage \[enc0\], cannot run \[dec1\]"):
        run_pipeline(mesh.g0, [Stage.board("dec1")], mesh.caps, [np.zeros(8)], ranks=[1])
    # ...and a node checks again on its own side if a coordinator sends it anyway.
    send_job(mesh.g0, 1, {"kind": "pipeline", "job": 999,
                          "stage": {"op": None, "stage_id": "dec1", "prev": 0, "next": 0}})
    reply = mesh.g0.recv(1, TAG_UP, timeout=5)
    assert reply["kind"] == "error" and reply["error"] == "PlacementError"
    assert reply["message"] == (
        "rank 1: fixed-function rank implements stage [enc0], cannot run [dec1]: an FPGA "
        "datapath is synthesized, not compiled")


class ReturningBoard:
    """A driver whose execute returns whatever it is told to."""

    descriptor = FixedFunction("mid", 2, 1)

    def __init__(self, value: Any) -> None:
        self.value = value

    def execute(self, x: np.ndarray) -> Any:
        return self.value


@pytest.mark.parametrize("value", [None, "ab", {"a": 1}, [1 + 2j]])
def test_a_board_returning_no_numbers_is_a_board_error_and_the_node_serves_on(
        mesh_factory, value):  # noqa: F811
    mesh = mesh_factory({1: {"board": DeadlineBoard(ReturningBoard(value))}})
    with pytest.raises(BoardError) as err:
        run_pipeline(mesh.g0, [Stage.board("mid")], mesh.caps, [np.zeros(2)], timeout=5.0)
    assert str(err.value).startswith("rank 1: fixed-function stage [mid]")
    assert "expected numbers" in str(err.value)
    assert 1 not in mesh.errors
    with pytest.raises(BoardError, match="expected numbers"):
        run_local([Stage.board("mid")], [np.zeros(2)], boards={"mid": ReturningBoard(value)})


class DtypeRecordingBoard:
    """A host driver that DMAs raw bytes: it needs exactly float32 in."""

    descriptor = FixedFunction("mid", 2, 2)

    def __init__(self) -> None:
        self.dtypes: list[str] = []

    def execute(self, x: np.ndarray) -> np.ndarray:
        self.dtypes.append(str(x.dtype))
        return np.frombuffer(np.ascontiguousarray(x).tobytes()[:8], dtype=np.float32).copy()


def test_a_board_is_always_fed_float32_whatever_dtype_arrives(mesh_factory):  # noqa: F811
    driver = DtypeRecordingBoard()
    mesh = mesh_factory({1: {"board": DeadlineBoard(driver)}})
    job = {"kind": "pipeline", "job": 903, **Stage.board("mid").to_message()}
    job["stage"] = {**job["stage"], "prev": 0, "next": 0, "index": 0}
    send_job(mesh.g0, 1, job)
    assert reply(mesh.g0, ("ready", "error"))["kind"] == "ready"
    mesh.g0.send(1, TAG_ACT, {"act": [903, 0], "x": np.array([[1.5, -2.0]], np.float64)})
    mesh.g0.send(1, TAG_ACT, {"act": [903, 1], "x": np.array([[3, 4]], np.int64)})
    mesh.g0.send(1, TAG_ACT, {"end": 903})
    got = []
    for _ in range(10):  # results, then the report
        _src, msg = mesh.g0.recv(None, TAG_UP, timeout=5.0)
        if "result" in msg:
            got.append(msg["x"].tolist())
        if msg.get("kind") == "report":
            break
    assert driver.dtypes == ["float32", "float32"]
    assert got == [[[1.5, -2.0]], [[3.0, 4.0]]]
