"""serve_node's job loop: each job goes to the handler of its kind, refusals are reported.

Ranks are threads on an in-process mesh running the same
:func:`meshkit.node.serve_node` a ``meshkit node`` process runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from tests.support.inproc_mesh import loopback, reply

from meshkit import MeshError, NodeReport, PeerLostError, RefusedError
from meshkit.node import (
    TAG_UP,
    NodeCaps,
    NodeControl,
    local_caps,
    report_job_error,
    send_job,
    serve_node,
)
from meshkit.pipeline import Stage, run_pipeline


class EchoJob:
    """A custom job kind: reports how many items the job carried."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, NodeCaps, dict[str, Any], NodeControl]] = []

    def __call__(self, group: Any, caps: NodeCaps, job: Any,
                 control: NodeControl) -> NodeReport | None:
        self.calls.append((group.rank, caps, dict(job), control))
        return NodeReport(rank=group.rank, job=job["job"], activations=len(job["items"]))


def test_serve_node_hands_a_custom_job_kind_to_its_handler(mesh_factory):  # noqa: F811
    echo = EchoJob()
    control = NodeControl()
    mesh = mesh_factory({1: {"jobs": {"echo": echo}, "control": control}})
    send_job(mesh.g0, 1, {"kind": "echo", "job": 41, "items": [1, 2, 3]})
    msg = reply(mesh.g0, ("report", "error"))
    assert (msg["src"], msg["kind"], msg["job"]) == (1, "report", 41)
    assert msg["report"]["type"] == "node" and msg["report"]["activations"] == 3
    ((rank, caps, job, given),) = echo.calls
    assert rank == 1 and caps == mesh.caps[0] and job["items"] == [1, 2, 3]
    assert given is control
    mesh.close()
    assert [(r.job, r.activations) for r in mesh.results[1]] == [(41, 3)]


def test_a_job_kind_no_handler_serves_is_reported_upstream_and_the_node_serves_on(
        mesh_factory):  # noqa: F811
    mesh = mesh_factory({1: {"jobs": {"echo": EchoJob()}}})
    send_job(mesh.g0, 1, {"kind": "teleport", "job": 42})
    msg = reply(mesh.g0, ("report", "error"))
    assert (msg["src"], msg["kind"], msg["job"], msg["error"]) == (1, "error", 42, "WireError")
    assert msg["message"] == "rank 1 does not know job kind 'teleport'"
    # Without a "pipeline" handler, a pipeline job is just another unknown kind.
    with pytest.raises(MeshError, match="rank 1 does not know job kind 'pipeline'"):
        run_pipeline(mesh.g0, [Stage(op="relu")], mesh.caps, [np.ones(2)], timeout=5.0)
    send_job(mesh.g0, 1, {"kind": "echo", "job": 43, "items": []})
    assert reply(mesh.g0, ("report", "error"))["kind"] == "report"
    assert 1 not in mesh.errors


def test_a_handler_that_refuses_a_job_sends_no_report_and_the_node_serves_on(
        mesh_factory):  # noqa: F811
    def refuse(group: Any, caps: NodeCaps, job: Any, control: NodeControl) -> None:
        report_job_error(group, job["job"], RefusedError(f"rank {group.rank} is busy"))
        return None

    mesh = mesh_factory({1: {"jobs": {"busy": refuse, "echo": EchoJob()}}})
    send_job(mesh.g0, 1, {"kind": "busy", "job": 44})
    msg = reply(mesh.g0, ("report", "error"))
    assert (msg["kind"], msg["error"], msg["message"]) == ("error", "RefusedError",
                                                           "rank 1 is busy")
    send_job(mesh.g0, 1, {"kind": "echo", "job": 45, "items": [0]})
    assert reply(mesh.g0, ("report", "error"))["job"] == 45
    mesh.close()
    assert [r.job for r in mesh.results[1]] == [45]


def test_a_pipeline_job_the_node_cannot_parse_is_reported_not_left_to_time_out(
        mesh_factory):  # noqa: F811
    mesh = mesh_factory({1: {}})
    # e.g. a newer coordinator shipping an op this node does not know
    send_job(mesh.g0, 1, {"kind": "pipeline", "job": 901,
                          "stage": {"op": "conv", "prev": 0, "next": 0, "index": 0}})
    msg = reply(mesh.g0, ("error", "ready"))
    assert msg["kind"] == "error" and msg["error"] == "WireError" and msg["job"] == 901
    assert "op must be one of" in msg["message"]
    again = run_pipeline(mesh.g0, [Stage(op="relu")], mesh.caps, [np.array([-1.0, 2.0])])
    assert again.outputs[0].tolist() == [0.0, 2.0]


def test_a_training_job_sent_to_a_fixed_function_rank_is_refused_by_the_node(mesh_factory):
    mesh = mesh_factory({1: {"board": loopback("enc0")}})
    send_job(mesh.g0, 1, {"kind": "train", "job": 5, "spec": {}})
    reply = mesh.g0.recv(1, TAG_UP, timeout=5)
    assert reply["kind"] == "error" and reply["error"] == "PlacementError"
    assert "rank 1 is a fixed-function rank implementing the pre-synthesized stage [enc0] " \
           "and cannot train: its datapath has no backward pass" in reply["message"]


class OneJobGroup:
    """Rank 1 whose coordinator sends one job and then (maybe) dies mid-job."""

    rank, world_size, timeout = 1, 2, 5.0

    def __init__(self, job: dict[str, Any]) -> None:
        self.jobs = [job]
        self.dead: dict[int, str] = {}
        self.sent: list[tuple[int, int, Any]] = []

    def send(self, dst: int, tag: int, payload: Any) -> None:
        if dst in self.dead:
            raise PeerLostError(f"rank {dst} is dead")
        self.sent.append((dst, tag, payload))

    def recv(self, src: int, tag: int, timeout: float | None = None) -> dict[str, Any]:
        if not self.jobs:
            raise PeerLostError("nothing queued")
        return self.jobs.pop(0)


def test_a_coordinator_lost_during_any_job_kind_makes_the_node_leave():
    group = OneJobGroup({"kind": "fit", "job": 46})

    def fit(group: Any, caps: NodeCaps, job: Any, control: NodeControl) -> None:
        group.dead[0] = "connection reset by peer"
        raise PeerLostError("rank 0 is dead: connection reset by peer")

    assert serve_node(group, local_caps(1), jobs={"fit": fit}, send_handshake=False) == []
    # A peer lost while the coordinator is alive is not the node's to swallow.
    group = OneJobGroup({"kind": "fit", "job": 47})

    def lose_a_peer(group: Any, caps: NodeCaps, job: Any, control: NodeControl) -> None:
        raise PeerLostError("rank 2 is dead")

    with pytest.raises(PeerLostError, match="rank 2 is dead"):
        serve_node(group, local_caps(1), jobs={"fit": lose_a_peer}, send_handshake=False)
