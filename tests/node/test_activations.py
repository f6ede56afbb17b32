"""The activation loop of one stage: failures unwind the pipeline, control lands exactly.

A stage that fails, a malformed frame, a stage before or after that dies:
each is reported, the job drains to its ``end``, and every node that is
still alive serves the next job. The stop handle and the step budget end
serving after an exact activation.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from inproc_mesh import JOBS, mesh_factory, reply  # noqa: F401  (the in-process mesh fixture)

from meshkit import MeshError, NodeControl, PeerLostError
from meshkit.node import TAG_ACT, TAG_JOB, TAG_UP, local_caps, send_job, serve_node
from meshkit.pipeline import Stage, run_pipeline


def raise_value_error(x: np.ndarray) -> np.ndarray:
    raise ValueError("bad input for this model")


def test_a_call_stage_that_raises_is_an_error_naming_the_stage_and_the_node_serves_on(
        mesh_factory):  # noqa: F811
    mesh = mesh_factory({1: {}})
    stage = Stage(op="call", function="test_activations:raise_value_error", stage_id="fc")
    with pytest.raises(MeshError) as err:
        run_pipeline(mesh.g0, [stage], mesh.caps, [np.zeros(2)], timeout=5.0)
    assert str(err.value) == ("rank 1: call stage [fc]: test_activations:raise_value_error "
                              "raised ValueError: bad input for this model")
    # The node did not crash: it reported and serves the next job.
    again = run_pipeline(mesh.g0, [Stage(op="scale", scale=2.0)], mesh.caps, [np.ones(2)])
    assert again.outputs[0].tolist() == [2.0, 2.0]
    assert 1 not in mesh.errors


def test_a_malformed_activation_is_reported_and_the_stage_still_reports_at_the_end(
        mesh_factory):  # noqa: F811
    mesh = mesh_factory({1: {}})
    job = {"kind": "pipeline", "job": 902, **Stage(op="identity").to_message()}
    job["stage"] = {**job["stage"], "prev": 0, "next": 0, "index": 0}
    send_job(mesh.g0, 1, job)
    assert reply(mesh.g0, ("ready", "error"))["kind"] == "ready"
    mesh.g0.send(1, TAG_ACT, {"act": [902, 0], "x": np.zeros(3, np.float32)})  # 1-D: malformed
    msg = reply(mesh.g0, ("error",))
    assert msg["error"] == "WireError" and "malformed activation from rank 0" in msg["message"]
    mesh.g0.send(1, TAG_ACT, {"end": 902})
    report = reply(mesh.g0, ("report",))
    assert report["report"]["stopped"] == "error" and report["job"] == 902


CONTROL: NodeControl | None = None


def stop_on_third(x: np.ndarray) -> np.ndarray:
    """A stage that raises the node's stop handle while serving activation #2 (0-based)."""
    if x[0] == 2:
        assert CONTROL is not None
        CONTROL.stop()
    return x


def test_the_stop_handle_ends_serving_after_the_current_activation(mesh_factory):
    global CONTROL
    CONTROL = NodeControl()
    mesh = mesh_factory({1: {"control": CONTROL}, 2: {}})
    stages = [Stage(op="call", function="test_activations:stop_on_third"), Stage(op="relu")]
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


DOOMED: dict[str, Any] = {}


def die_on_second(x: np.ndarray) -> np.ndarray:
    """A stage whose node drops off the mesh while serving activation #1."""
    if x[0] == 1:
        DOOMED["group"].close()
    return x


def test_a_stage_that_dies_is_an_error_and_the_stages_after_it_are_released(mesh_factory):
    mesh = mesh_factory({1: {}, 2: {}}, timeout=10.0)
    DOOMED["group"] = mesh.groups[1]
    stages = [Stage(op="call", function="test_activations:die_on_second"), Stage(op="relu")]
    xs = [np.full(2, i, np.float32) for i in range(6)]
    with pytest.raises(PeerLostError, match=r"rank\(s\) \[1\] died"):
        run_pipeline(mesh.g0, stages, mesh.caps, xs, in_flight=2, batch=1)
    # Rank 2 was told to abort the job and serves the next one.
    again = run_pipeline(mesh.g0, [Stage(op="scale", scale=3.0)], mesh.caps,
                         [np.ones(2)], ranks=[2])
    assert again.outputs[0].tolist() == [3.0, 3.0]
    mesh.threads[0].join(10)
    assert "closed" in str(mesh.errors[1])  # the dead node's own loop ended, not hung


def test_a_later_stage_dying_leaves_the_stage_before_it_serving(mesh_factory):  # noqa: F811
    mesh = mesh_factory({1: {}, 2: {}, 3: {}}, timeout=10.0)
    DOOMED["group"] = mesh.groups[2]
    stages = [Stage(op="identity"), Stage(op="call", function="test_activations:die_on_second"),
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
        if dst == 2:
            raise PeerLostError("rank 2 is dead: connection reset by peer")
        self.sent.append((dst, tag, dict(payload)))

    def recv(self, src: int, tag: int, timeout: float | None = None) -> dict[str, Any]:
        queue = self.script.get(tag)
        if not queue:
            raise PeerLostError("nothing queued")
        return queue.pop(0)


def test_a_stage_whose_next_stage_died_reports_an_error_and_keeps_serving():
    job = {"kind": "pipeline", "job": 5, **Stage(op="identity").to_message()}
    job["stage"] = {**job["stage"], "prev": 0, "next": 2, "index": 0}
    group = ScriptedGroup({
        TAG_JOB: [job, {"kind": "shutdown"}],
        TAG_ACT: [{"act": [5, 0], "x": np.ones((1, 2), np.float32)}, {"end": 5}],
    })
    reports = serve_node(group, local_caps(1), jobs=JOBS, send_handshake=False)  # did not raise
    assert [r.stopped for r in reports] == ["error"]
    up = [msg for dst, tag, msg in group.sent if tag == TAG_UP]
    assert [m["kind"] for m in up] == ["ready", "error", "report"]
    assert up[1]["error"] == "PeerLostError"
    assert up[1]["message"] == ("rank 1 could not pass activations on to rank 2: rank 2 is "
                                "dead: connection reset by peer")
