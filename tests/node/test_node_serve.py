"""serve_node's job loop: each job goes to the handler of its kind, refusals are reported.

Ranks are threads on an in-process mesh running the same
:func:`meshkit.node.serve_node` a ``meshkit node`` process runs.
"""

from __future__ import annotations

import numpy as np
from inproc_mesh import loopback, mesh_factory, reply  # noqa: F401  (the mesh fixture)

from meshkit.node import TAG_UP, send_job
from meshkit.pipeline import Stage, run_pipeline


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
