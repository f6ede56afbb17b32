"""Activations served on the reader thread (tcp): the promises of the serving path still hold.

Over ``tcp`` every link has its own reader thread, and a stage runs each
activation on the reader that authenticated it (no hand-off to a serving
thread). These tests pin down that it does, and that the stop handle and
the step budget still land on an exact activation, and that a slow stage
holds up only the link it reads from.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from meshkit import NodeControl, PeerLostError
from meshkit.pipeline import Stage, run_pipeline

#: The thread names each rank's stage ran on (filled by ``where``).
THREADS: dict[int, set[str]] = {}
STATE: dict[str, Any] = {}


def where(x: np.ndarray) -> np.ndarray:
    # A reader is "meshkit-tcp-r<rank>-from-<peer>"; a node's own serving
    # thread (inproc_mesh) "mesh-node-r<rank>".
    name = threading.current_thread().name
    rank = STATE["rank_of"][next(p for p in name.split("-") if p.startswith("r"))]
    THREADS.setdefault(int(rank), []).append(name)
    return x + 1


def stop_on_third(x: np.ndarray) -> np.ndarray:
    if x[0] == 2:
        STATE["control"].stop()
    return x


def wait_for_rank_0(x: np.ndarray) -> np.ndarray:
    """A slow stage: it holds its reader until rank 0 sends it a frame on another link."""
    if x[0] == 0:
        got = STATE["group"].recv(0, 77, timeout=10)
        STATE["got"] = got["n"]
    return x


@pytest.fixture(autouse=True)
def _fresh():
    THREADS.clear()
    STATE.clear()
    yield


@pytest.mark.parametrize("topology", ["mesh", "star"])
def test_activations_are_served_on_the_thread_that_read_them(mesh_factory, topology):
    mesh = mesh_factory({1: {}, 2: {}, 3: {}}, transport="tcp", topology=topology)
    STATE["rank_of"] = {f"r{r}": r for r in (1, 2, 3)}
    stages = [Stage(op="call", function=f"{__name__}:where")] * 3
    xs = [np.full(4, i, np.float32) for i in range(20)]
    for in_flight in (1, 8):
        result = run_pipeline(mesh.g0, stages, mesh.caps, xs, in_flight=in_flight, batch=1)
        assert [y.tolist() for y in result.outputs] == [[i + 3.0] * 4 for i in range(20)]
    # Each stage ran on the reader of the link its activations came in on:
    # rank 1 on the one from rank 0, and ranks 2 and 3 on the one from the
    # rank before them (in a star every frame comes in from the coordinator).
    # A frame that lands while the reader is not armed (the serving thread
    # still busy with the one before) is served by the node's own thread;
    # no other thread ever runs a stage.
    for rank in (1, 2, 3):
        prev = 0 if topology == "star" or rank == 1 else rank - 1
        reader = f"meshkit-tcp-r{rank}-from-{prev}"
        assert len(THREADS[rank]) == 40
        assert set(THREADS[rank]) <= {reader, f"mesh-node-r{rank}"}, THREADS[rank]
        assert THREADS[rank].count(reader) >= 20, THREADS[rank]


def test_the_stop_handle_lands_on_an_exact_activation_on_the_reader(mesh_factory):
    control = STATE["control"] = NodeControl()
    mesh = mesh_factory({1: {"control": control}, 2: {}}, transport="tcp", topology="mesh")
    stages = [Stage(op="call", function=f"{__name__}:stop_on_third"), Stage(op="relu")]
    xs = [np.full(3, i, np.float32) for i in range(10)]
    with pytest.raises(PeerLostError) as err:
        run_pipeline(mesh.g0, stages, mesh.caps, xs, in_flight=4, batch=1)
    assert "rank 1 left pipeline job" in str(err.value)
    assert "after 3 activation(s) (stop: stop handle raised)" in str(err.value)
    mesh.threads[0].join(10)
    (report,) = mesh.results[1]
    assert report.activations == 3 and report.stopped == "stop"
    mesh.close()
    (downstream,) = mesh.results[2]
    assert downstream.activations == 3 and downstream.stopped is None


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("topology", ["mesh", "star"])
def test_a_step_budget_of_n_serves_exactly_n_on_the_reader(mesh_factory, batch, topology):
    mesh = mesh_factory({1: {}, 2: {"control": NodeControl(steps=4)}, 3: {}},
                        transport="tcp", topology=topology)
    stages = [Stage(op="identity"), Stage(op="scale", scale=2.0), Stage(op="identity")]
    with pytest.raises(PeerLostError, match=r"rank 2 left .* after 4 activation\(s\) "
                                            r"\(budget: step budget spent\)"):
        run_pipeline(mesh.g0, stages, mesh.caps, [np.ones(2)] * 9, in_flight=6, batch=batch)
    mesh.close()
    (report,) = mesh.results[2]
    assert report.activations == 4 and report.stopped == "budget"
    assert mesh.results[3][0].activations == 4


def test_a_slow_stage_does_not_hold_up_other_ranks_frames(mesh_factory):
    # Rank 1 serves the second stage (its activations come in from rank 2)
    # and stalls on its first one until a frame from rank 0 reaches it:
    # that frame comes in on another link, whose reader the stalled stage
    # must not be holding.
    mesh = mesh_factory({1: {}, 2: {}}, transport="tcp", topology="mesh")
    STATE["group"] = mesh.groups[1]
    stages = [Stage(op="identity"), Stage(op="call", function=f"{__name__}:wait_for_rank_0")]
    out: dict[str, Any] = {}

    def drive() -> None:
        out["result"] = run_pipeline(mesh.g0, stages, mesh.caps,
                                     [np.full(2, i, np.float32) for i in range(5)],
                                     ranks=[2, 1], in_flight=2, batch=1)

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    mesh.g0.send(1, 77, {"n": 5})
    driver.join(20)
    assert not driver.is_alive()
    assert STATE["got"] == 5
    assert [y[0] for y in out["result"].outputs] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("transport", ["inproc", "tcp"])
def test_a_stage_answers_in_the_form_it_was_fed(mesh_factory, transport):
    # run_pipeline sends the compact form ({"act/<job>/<seq>": x}, one entry a
    # frame); a frame in the {"act": [job, seq], "x": x} form still works and
    # is answered in its own form.
    from meshkit.node import TAG_ACT, TAG_UP, send_job

    mesh = mesh_factory({1: {}}, transport=transport)
    job = {"kind": "pipeline", "job": 904, **Stage(op="scale", scale=2.0).to_message()}
    job["stage"] = {**job["stage"], "prev": 0, "next": 0, "index": 0}
    send_job(mesh.g0, 1, job)
    assert mesh.g0.recv(1, TAG_UP, timeout=5)["kind"] == "ready"
    mesh.g0.send(1, TAG_ACT, {"act/904/0": np.ones((2, 3), np.float32)})
    mesh.g0.send(1, TAG_ACT, {"act": [904, 2], "x": np.ones((1, 3), np.float32)})
    mesh.g0.send(1, TAG_ACT, {"act/903/0": np.ones((1, 3), np.float32)})  # stale: dropped
    mesh.g0.send(1, TAG_ACT, {"end": 904})
    first = mesh.g0.recv(1, TAG_UP, timeout=5)
    second = mesh.g0.recv(1, TAG_UP, timeout=5)
    report = mesh.g0.recv(1, TAG_UP, timeout=5)
    assert list(first) == ["result/904/0"] and first["result/904/0"].tolist() == [[2.0] * 3] * 2
    assert second["result"] == [904, 2] and second["x"].tolist() == [[2.0] * 3]
    assert report["kind"] == "report" and report["report"]["activations"] == 3
