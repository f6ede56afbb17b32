"""Nodes serving a streamed pipeline end to end: outputs match the local reference.

``run_pipeline`` on an in-process mesh of ``serve_node`` ranks (workers and a
board): outputs in input order, equal to ``run_local``; ``on_output``
streams them in order and keeps none; the nodes serve the next job.
"""

from __future__ import annotations

import numpy as np
import pytest
from tests.support.inproc_mesh import loopback

from meshkit.pipeline import Stage, run_local, run_pipeline


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
