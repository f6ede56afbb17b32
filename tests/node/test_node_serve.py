"""Serving on a real (in-process) mesh: refusals, the stop handle, the step budget.

Ranks are threads joined through the ``inproc`` transport, each running the
same :func:`meshkit.node.serve_node` a ``meshkit node`` process runs.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import numpy as np
import pytest

from meshkit import FixedFunction, NodeConfig, NodeControl, PeerLostError, PlacementError
from meshkit.node.board import DeadlineBoard, open_board
from meshkit.node import (
    TAG_UP,
    NodeReport,
    local_caps,
    collect_caps,
    send_job,
    serve_fixed_function,
    serve_node,
    serve_worker,
    shutdown_nodes,
)
from meshkit.pipeline import Stage, run_local, run_pipeline

_hubs = itertools.count()


class Mesh:
    """A coordinator (this thread) plus worker threads running ``serve_node``."""

    def __init__(self, nodes: dict[int, dict[str, Any]], timeout: float = 10.0) -> None:
        self.world = max(nodes) + 1
        hub = f"inproc://serve-{next(_hubs)}"
        self.results: dict[int, Any] = {}
        self.errors: dict[int, BaseException] = {}
        self.groups: dict[int, Any] = {}
        self.nodes = nodes

        def config(rank: int) -> NodeConfig:
            return NodeConfig(rank=rank, world=self.world, peers=[hub], topology="star",
                              transport="inproc", secret=b"test-secret", timeout=timeout)

        def run(rank: int) -> None:
            spec = nodes[rank]
            try:
                group = self.groups[rank] = config(rank).connect()
                caps = spec.get("caps") or local_caps(rank, fixed_function=(
                    spec["board"].descriptor if spec.get("board") else None))
                self.results[rank] = serve_node(group, caps, board=spec.get("board"),
                                                control=spec.get("control"))
            except BaseException as exc:  # handed to the test
                self.errors[rank] = exc

        self.threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in nodes]
        for t in self.threads:
            t.start()
        self.g0 = config(0).connect()
        self.g0.wait_for_workers()
        self.caps = collect_caps(self.g0, hook=False)

    def join(self) -> None:
        for t in self.threads:
            t.join(10)
            assert not t.is_alive(), "a node did not leave"

    def close(self) -> None:
        shutdown_nodes(self.g0)
        self.join()
        self.g0.close()
        for g in self.groups.values():
            g.close()


@pytest.fixture
def mesh_factory():
    made: list[Mesh] = []

    def make(nodes: dict[int, dict[str, Any]], **kw: Any) -> Mesh:
        mesh = Mesh(nodes, **kw)
        made.append(mesh)
        return mesh

    yield make
    for mesh in made:
        mesh.close()


def loopback(stage_id: str = "mid", n_in: int = 8, n_out: int = 8, **options: Any) -> DeadlineBoard:
    return open_board("loopback", {"stage_id": stage_id, "input_elems": n_in,
                                   "output_elems": n_out, **options})


class WrongOutputBoard:
    """A driver whose datapath disagrees with its own descriptor."""

    descriptor = FixedFunction("mid", 8, 8)

    def execute(self, x: np.ndarray) -> np.ndarray:
        return x[:4].copy()


CONTROL: NodeControl | None = None


def stop_on_third(x: np.ndarray) -> np.ndarray:
    """A stage that raises the node's stop handle while serving activation #2 (0-based)."""
    if x[0] == 2:
        assert CONTROL is not None
        CONTROL.stop()
    return x


def test_a_three_stage_pipeline_matches_the_stages_computed_locally(mesh_factory):
    board = loopback(function="scale", scale=0.5)
    mesh = mesh_factory({1: {}, 2: {"board": board}, 3: {}})
    rng = np.random.default_rng(1)
    stages = [Stage.affine(rng.standard_normal((4, 8)), rng.standard_normal(8),
                           activation="relu"),
              Stage.board("mid"),
              Stage.affine(rng.standard_normal((8, 3)), activation="tanh")]
    xs = [rng.standard_normal(4).astype(np.float32) for _ in range(25)]
    result = run_pipeline(mesh.g0, stages, mesh.caps, xs, in_flight=8, batch=3)
    expected = run_local(stages, xs, boards={"mid": board})
    assert len(result.outputs) == 25
    for got, want in zip(result.outputs, expected):
        np.testing.assert_array_equal(got, want)
    assert result.placement.ranks == (1, 2, 3)
    assert {r: rep.activations for r, rep in result.reports.items()} == {1: 25, 2: 25, 3: 25}
    assert result.reports[2].role == "fixed_function" and result.reports[2].stage_id == "mid"
    # The nodes keep serving: a second job on the same mesh works too.
    again = run_pipeline(mesh.g0, stages, mesh.caps, xs[:3], in_flight=1)
    for got, want in zip(again.outputs, expected[:3]):
        np.testing.assert_array_equal(got, want)


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
        serve_node(object(), advertised, board=loopback("dec1"))
    assert str(err.value) == (
        "the board implements stage [dec1] (8 -> 8 float32) but this rank advertises stage "
        "[enc0] (8 -> 8 float32): fix the board options or the advertised descriptor so "
        "they agree")
    with pytest.raises(PlacementError, match=r"implements stage \[enc0\] \(8 -> 4"):
        serve_fixed_function(object(), loopback("enc0", 8, 4, function="test_node_serve:half"),
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


def test_a_training_job_sent_to_a_fixed_function_rank_is_refused_by_the_node(mesh_factory):
    mesh = mesh_factory({1: {"board": loopback("enc0")}})
    send_job(mesh.g0, 1, {"kind": "train", "job": 5, "spec": {}})
    reply = mesh.g0.recv(1, TAG_UP, timeout=5)
    assert reply["kind"] == "error" and reply["error"] == "PlacementError"
    assert "rank 1 is a fixed-function rank implementing the pre-synthesized stage [enc0] " \
           "and cannot train: its datapath has no backward pass" in reply["message"]


def test_the_stop_handle_ends_serving_after_the_current_activation(mesh_factory):
    global CONTROL
    CONTROL = NodeControl()
    mesh = mesh_factory({1: {"control": CONTROL}, 2: {}})
    stages = [Stage(op="call", function="test_node_serve:stop_on_third"), Stage(op="relu")]
    xs = [np.full(3, i, np.float32) for i in range(10)]
    with pytest.raises(PeerLostError) as err:
        run_pipeline(mesh.g0, stages, mesh.caps, xs, in_flight=4)
    assert "rank 1 left pipeline job" in str(err.value)
    assert "after 3 activation(s) (stop: stop handle raised)" in str(err.value)
    mesh.threads[0].join(10)
    (report,) = mesh.results[1]
    assert report.activations == 3 and report.stopped == "stop"
    mesh.close()
    # The activation in progress when stop was raised still went on down the pipe,
    # and nothing after it: rank 2 served exactly three, then the end rank 1 sent.
    (downstream,) = mesh.results[2]
    assert downstream.activations == 3 and downstream.stopped is None


@pytest.mark.parametrize("batch", [1, 3])
def test_a_step_budget_of_n_serves_exactly_n(mesh_factory, batch):
    # With batch 3 the budget runs out inside a frame of three activations.
    mesh = mesh_factory({1: {}, 2: {"control": NodeControl(steps=4)}, 3: {}})
    stages = [Stage(op="identity"), Stage(op="scale", scale=2.0), Stage(op="identity")]
    with pytest.raises(PeerLostError, match=r"rank 2 left .* after 4 activation\(s\) "
                                            r"\(budget: step budget spent\)"):
        run_pipeline(mesh.g0, stages, mesh.caps, [np.ones(2)] * 9, in_flight=6, batch=batch)
    mesh.close()
    (report,) = mesh.results[2]
    assert report.activations == 4 and report.stopped == "budget"
    assert mesh.results[3][0].activations == 4


def test_a_parked_worker_leaves_promptly_when_stopped():
    hub = "inproc://parked"
    cfg = [NodeConfig(rank=r, world=2, peers=[hub], topology="star", transport="inproc",
                      secret=b"k", timeout=5) for r in range(2)]
    groups: dict[int, Any] = {}
    t = threading.Thread(target=lambda: groups.__setitem__(1, cfg[1].connect()))
    t.start()
    groups[0] = cfg[0].connect()
    t.join(5)
    control = NodeControl()
    out: list[NodeReport] = []
    worker = threading.Thread(target=lambda: out.append(
        serve_worker(groups[1], control=control)))
    worker.start()
    control.stop()
    worker.join(5)
    assert not worker.is_alive()
    assert out[0].activations == 0 and out[0].stopped == "stop"
    for g in groups.values():
        g.close()


DOOMED: dict[str, Any] = {}


def die_on_second(x: np.ndarray) -> np.ndarray:
    """A stage whose node drops off the mesh while serving activation #1."""
    if x[0] == 1:
        DOOMED["group"].close()
    return x


def test_a_stage_that_dies_is_an_error_and_the_stages_after_it_are_released(mesh_factory):
    mesh = mesh_factory({1: {}, 2: {}}, timeout=10.0)
    DOOMED["group"] = mesh.groups[1]
    stages = [Stage(op="call", function="test_node_serve:die_on_second"), Stage(op="relu")]
    xs = [np.full(2, i, np.float32) for i in range(6)]
    with pytest.raises(PeerLostError, match=r"rank\(s\) \[1\] died"):
        run_pipeline(mesh.g0, stages, mesh.caps, xs, in_flight=2, batch=1)
    # Rank 2 was told to abort the job and serves the next one.
    again = run_pipeline(mesh.g0, [Stage(op="scale", scale=3.0)], mesh.caps,
                         [np.ones(2)], ranks=[2])
    assert again.outputs[0].tolist() == [3.0, 3.0]
    mesh.threads[0].join(10)
    assert "closed" in str(mesh.errors[1])  # the dead node's own loop ended, not hung


def test_on_output_streams_every_output_in_input_order_and_keeps_none(mesh_factory):
    mesh = mesh_factory({1: {}, 2: {}})
    stages = [Stage(op="scale", scale=2.0), Stage(op="relu")]
    xs = [np.full(3, i - 10, np.float32) for i in range(40)]
    seen: list[tuple[int, list[float]]] = []
    result = run_pipeline(mesh.g0, stages, mesh.caps, xs, in_flight=8, batch=2,
                          on_output=lambda i, y: seen.append((i, y.tolist())))
    expected = run_local(stages, xs)
    assert [i for i, _ in seen] == list(range(40))
    assert [y for _, y in seen] == [e.tolist() for e in expected]
    assert result.outputs == [] and result.count == 40
    assert {r: rep.activations for r, rep in result.reports.items()} == {1: 40, 2: 40}


def test_an_on_output_that_raises_aborts_the_pipeline_and_the_nodes_serve_on(mesh_factory):
    mesh = mesh_factory({1: {}, 2: {}})
    stages = [Stage(op="identity"), Stage(op="identity")]

    def refuse_fifth(index: int, y: np.ndarray) -> None:
        if index == 4:
            raise ValueError("consumer full")

    with pytest.raises(ValueError, match="consumer full"):
        run_pipeline(mesh.g0, stages, mesh.caps, [np.ones(2)] * 30, in_flight=4,
                     on_output=refuse_fifth)
    again = run_pipeline(mesh.g0, stages, mesh.caps, [np.ones(2)] * 3)
    assert again.count == 3 and [y.tolist() for y in again.outputs] == [[1.0, 1.0]] * 3
