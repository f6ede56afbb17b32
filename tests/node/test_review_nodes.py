"""Review (R3): nodes, boards and pipelines fail with clear MeshErrors, never tracebacks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_node_serve import mesh_factory  # noqa: F401  (the in-process mesh fixture)

from meshkit import BoardError, ConfigError, FixedFunction, MeshError
from meshkit.node.board import DeadlineBoard, open_board
from meshkit.pipeline import Stage, run_local, run_pipeline


def raise_value_error(x: np.ndarray) -> np.ndarray:
    raise ValueError("bad input for this model")


def return_nothing(x: np.ndarray) -> None:
    """A stage function that forgot its return statement."""


def return_text(x: np.ndarray) -> str:
    return "not numbers"


class ReturningBoard:
    """A driver whose execute returns whatever it is told to."""

    descriptor = FixedFunction("mid", 2, 1)

    def __init__(self, value: Any) -> None:
        self.value = value

    def execute(self, x: np.ndarray) -> Any:
        return self.value


def test_a_call_stage_that_raises_is_an_error_naming_the_stage_and_the_node_serves_on(
        mesh_factory):  # noqa: F811
    mesh = mesh_factory({1: {}})
    stage = Stage(op="call", function="test_review_nodes:raise_value_error", stage_id="fc")
    with pytest.raises(MeshError) as err:
        run_pipeline(mesh.g0, [stage], mesh.caps, [np.zeros(2)], timeout=5.0)
    assert str(err.value) == ("rank 1: call stage [fc]: test_review_nodes:raise_value_error "
                              "raised ValueError: bad input for this model")
    # The node did not crash: it reported and serves the next job.
    again = run_pipeline(mesh.g0, [Stage(op="scale", scale=2.0)], mesh.caps, [np.ones(2)])
    assert again.outputs[0].tolist() == [2.0, 2.0]
    assert 1 not in mesh.errors


@pytest.mark.parametrize("function, found", [
    ("test_review_nodes:return_nothing", "None"),
    ("test_review_nodes:return_text", "'not numbers'"),
])
def test_a_call_stage_returning_no_numbers_is_refused_not_turned_into_nan(function, found):
    stage = Stage(op="call", function=function, stage_id="fc")
    with pytest.raises(MeshError) as err:
        stage.run(np.zeros(2, np.float32))
    assert str(err.value).startswith("call stage [fc]")
    assert found in str(err.value)


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


def test_a_loopback_function_returning_none_is_a_board_error():
    board = open_board("loopback", {"stage_id": "s", "input_elems": 2, "output_elems": 1,
                                    "function": "test_review_nodes:return_nothing"})
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


def test_discovery_data_ports_past_65535_are_refused_naming_the_setting():
    from meshkit import NodeConfig

    # Rank r listens on data_base + r: rank 1 of 2 would need port 65536. Before
    # this was refused, discovery dropped the datagram and the node timed out.
    with pytest.raises(ConfigError) as err:
        NodeConfig(rank=1, world=2, discover=True, data_base=65535, secret=b"s")
    assert str(err.value) == (
        "data_base 65535: with discovery, rank r listens on data_base + r, so a world of "
        "2 needs ports up to 65536; choose a data_base of at most 65534")
    with pytest.raises(ConfigError, match="needs ports up to 65536"):
        NodeConfig.from_env({"RANK": "1", "WORLD": "2", "DISCOVER": "1", "DATA_PORT": "65535"})
    assert NodeConfig(rank=1, world=2, discover=True, data_base=65534).data_base == 65534
    # Without discovery the data ports are not used.
    assert NodeConfig(rank=1, world=2, peers=["h:1"], data_base=65535).data_base == 65535


def _node(*extra: str) -> Any:
    from click.testing import CliRunner

    from meshkit.cli import main

    base = ["node", "--rank", "1", "--world", "2", "--peers", "127.0.0.1:9", "--board",
            "loopback", "--board-option", "input_elems=2", "--board-option", "output_elems=2"]
    return CliRunner().invoke(main, [*base, *extra], env={"MESHKIT_SECRET": "s"})


@pytest.mark.parametrize("options, message", [
    (["stage_id=s", "dtype=float64"], "[board] 'dtype' must be in"),
    (["stage_id="], "[board] FixedFunction.stage_id must not be empty"),
    (["stage_id=s", "function=r3_broken_board_module:run"],
     ("[board] function: cannot import module 'r3_broken_board_module': RuntimeError: "
      "boom at import")),
])
def test_bad_board_options_exit_2_with_a_message_not_a_traceback(tmp_path, monkeypatch,
                                                                  options, message):
    (tmp_path / "r3_broken_board_module.py").write_text(
        "raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    flags = [f for option in options for f in ("--board-option", option)]
    result = _node(*flags)
    assert result.exit_code == 2, result.exception
    assert message in result.output


def _reply(g0: Any, kinds: tuple[str, ...]) -> dict[str, Any]:
    from meshkit.node import TAG_UP

    for _ in range(10):  # bounded: skip nothing but what the test does not ask for
        src, msg = g0.recv(None, TAG_UP, timeout=5.0)
        if msg.get("kind") in kinds:
            return {"src": src, **msg}
    raise AssertionError(f"no {kinds} reply")


def test_a_pipeline_job_the_node_cannot_parse_is_reported_not_left_to_time_out(
        mesh_factory):  # noqa: F811
    from meshkit.node import send_job

    mesh = mesh_factory({1: {}})
    # e.g. a newer coordinator shipping an op this node does not know
    send_job(mesh.g0, 1, {"kind": "pipeline", "job": 901,
                          "stage": {"op": "conv", "prev": 0, "next": 0, "index": 0}})
    msg = _reply(mesh.g0, ("error", "ready"))
    assert msg["kind"] == "error" and msg["error"] == "WireError" and msg["job"] == 901
    assert "op must be one of" in msg["message"]
    again = run_pipeline(mesh.g0, [Stage(op="relu")], mesh.caps, [np.array([-1.0, 2.0])])
    assert again.outputs[0].tolist() == [0.0, 2.0]


def test_a_malformed_activation_is_reported_and_the_stage_still_reports_at_the_end(
        mesh_factory):  # noqa: F811
    from meshkit.node import TAG_ACT, send_job

    mesh = mesh_factory({1: {}})
    job = {"kind": "pipeline", "job": 902, **Stage(op="identity").to_message()}
    job["stage"] = {**job["stage"], "prev": 0, "next": 0, "index": 0}
    send_job(mesh.g0, 1, job)
    assert _reply(mesh.g0, ("ready", "error"))["kind"] == "ready"
    mesh.g0.send(1, TAG_ACT, {"act": [902, 0], "x": np.zeros(3, np.float32)})  # 1-D: malformed
    msg = _reply(mesh.g0, ("error",))
    assert msg["error"] == "WireError" and "malformed activation from rank 0" in msg["message"]
    mesh.g0.send(1, TAG_ACT, {"end": 902})
    report = _reply(mesh.g0, ("report",))
    assert report["report"]["stopped"] == "error" and report["job"] == 902


DOOMED: dict[str, Any] = {}


def die_on_second(x: np.ndarray) -> np.ndarray:
    """A stage whose node drops off the mesh while serving activation #1."""
    if x[0] == 1:
        DOOMED["group"].close()
    return x


def test_a_later_stage_dying_leaves_the_stage_before_it_serving(mesh_factory):  # noqa: F811
    mesh = mesh_factory({1: {}, 2: {}, 3: {}}, timeout=10.0)
    DOOMED["group"] = mesh.groups[2]
    stages = [Stage(op="identity"), Stage(op="call", function="test_review_nodes:die_on_second"),
              Stage(op="relu")]
    xs = [np.full(2, i, np.float32) for i in range(12)]
    with pytest.raises(MeshError, match=r"rank\(s\) \[2\] died"):
        run_pipeline(mesh.g0, stages, mesh.caps, xs, in_flight=4, batch=1)
    # Rank 1 (upstream of the dead rank) did not crash: it serves the next job.
    again = run_pipeline(mesh.g0, [Stage(op="scale", scale=3.0), Stage(op="relu")],
                         mesh.caps, [np.ones(2)], ranks=[1, 3])
    assert again.outputs[0].tolist() == [3.0, 3.0]
    assert 1 not in mesh.errors and 3 not in mesh.errors


class ScriptedGroup:
    """Rank 1 of a full mesh whose next stage (rank 2) has died: sends to it fail."""

    rank, world_size, timeout = 1, 4, 5.0

    def __init__(self, script: dict[int, list[dict[str, Any]]]) -> None:
        self.script = script
        self.sent: list[tuple[int, int, dict[str, Any]]] = []
        self.dead: dict[int, str] = {}

    def send(self, dst: int, tag: int, payload: dict[str, Any]) -> None:
        from meshkit import PeerLostError

        if dst == 2:
            raise PeerLostError("rank 2 is dead: connection reset by peer")
        self.sent.append((dst, tag, dict(payload)))

    def recv(self, src: int, tag: int, timeout: float | None = None) -> dict[str, Any]:
        from meshkit import PeerLostError

        queue = self.script.get(tag)
        if not queue:
            raise PeerLostError("nothing queued")
        return queue.pop(0)


def test_a_stage_whose_next_stage_died_reports_an_error_and_keeps_serving():
    from meshkit.node import TAG_ACT, TAG_JOB, TAG_UP, local_caps, serve_node

    job = {"kind": "pipeline", "job": 5, **Stage(op="identity").to_message()}
    job["stage"] = {**job["stage"], "prev": 0, "next": 2, "index": 0}
    group = ScriptedGroup({
        TAG_JOB: [job, {"kind": "shutdown"}],
        TAG_ACT: [{"act": [5, 0], "x": np.ones((1, 2), np.float32)}, {"end": 5}],
    })
    reports = serve_node(group, local_caps(1), send_handshake=False)  # did not raise
    assert [r.stopped for r in reports] == ["error"]
    up = [msg for dst, tag, msg in group.sent if tag == TAG_UP]
    assert [m["kind"] for m in up] == ["ready", "error", "report"]
    assert up[1]["error"] == "PeerLostError"
    assert up[1]["message"] == ("rank 1 could not pass activations on to rank 2: rank 2 is "
                                "dead: connection reset by peer")


class DtypeRecordingBoard:
    """A host driver that DMAs raw bytes: it needs exactly float32 in."""

    descriptor = FixedFunction("mid", 2, 2)

    def __init__(self) -> None:
        self.dtypes: list[str] = []

    def execute(self, x: np.ndarray) -> np.ndarray:
        self.dtypes.append(str(x.dtype))
        return np.frombuffer(np.ascontiguousarray(x).tobytes()[:8], dtype=np.float32).copy()


def test_a_board_is_always_fed_float32_whatever_dtype_arrives(mesh_factory):  # noqa: F811
    from meshkit.node import TAG_ACT, TAG_UP, send_job

    driver = DtypeRecordingBoard()
    mesh = mesh_factory({1: {"board": DeadlineBoard(driver)}})
    job = {"kind": "pipeline", "job": 903, **Stage.board("mid").to_message()}
    job["stage"] = {**job["stage"], "prev": 0, "next": 0, "index": 0}
    send_job(mesh.g0, 1, job)
    assert _reply(mesh.g0, ("ready", "error"))["kind"] == "ready"
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
