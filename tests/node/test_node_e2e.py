"""End to end with real processes on 127.0.0.1: `meshkit node` workers and a board rank.

The coordinator runs in the test process over the ``tcp`` transport; two
``meshkit node`` workers and one ``meshkit node --board loopback`` rank run
as subprocesses, exactly as a user would start them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import meshkit
from meshkit import NodeCaps, NodeConfig, PlacementError
from meshkit.node.board import open_board
from meshkit.node import collect_caps, shutdown_nodes
from meshkit.pipeline import Stage, place_training, run_local, run_pipeline

from tests.support.cli import run_cli
from meshkit.train import free_ports
pytestmark = pytest.mark.slow

SECRET = b"e2e-secret-0123456789abcdef"


class Recorder:
    def __init__(self) -> None:
        self.joined: list[NodeCaps] = []

    @meshkit.hookimpl
    def meshkit_node_joined(self, caps):
        self.joined.append(caps)


def _node(args: list[str], secret_file: Path | None,
          env_extra: dict[str, str] | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MESHKIT_SECRET", "RANK", "WORLD", "PEERS", "MESHKIT_PLUGINS",
                        "MESHKIT_DISABLE_PLUGINS", "TOPOLOGY", "DEVICE", "DISCOVER")}
    env.update(env_extra or {})
    secret = ["--secret-file", str(secret_file)] if secret_file is not None else []
    return subprocess.Popen(
        [sys.executable, "-m", "meshkit", "node", *args, *secret],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_a_three_stage_pipeline_across_real_processes(tmp_path):
    from meshkit.plugins import build_manager

    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET)
    secret_file.chmod(0o600)
    rng = np.random.default_rng(7)
    w_board = rng.standard_normal((6, 6)).astype(np.float32)
    b_board = rng.standard_normal(6).astype(np.float32)
    np.save(tmp_path / "w.npy", w_board)
    np.save(tmp_path / "b.npy", b_board)
    board_options = {"stage_id": "fpga.mid", "input_elems": 6, "output_elems": 6,
                     "function": "affine", "weights": str(tmp_path / "w.npy"),
                     "bias": str(tmp_path / "b.npy")}

    coordinator = NodeConfig(rank=0, world=4, topology="star", bind="127.0.0.1:0",
                             transport="tcp", secret=SECRET, timeout=20).connect()
    procs: list[subprocess.Popen] = []
    try:
        address = coordinator.address
        common = ["--world", "4", "--peers", address, "--topology", "star", "--timeout", "20"]
        procs.append(_node(["--rank", "1", *common], secret_file))
        procs.append(_node(["--rank", "2", *common, "--board", "loopback",
                            *[f"--board-option={k}={v}" for k, v in board_options.items()]],
                           secret_file))
        # Rank 3 is configured from the environment alone, as from_env reads it.
        procs.append(_node(["--timeout", "20"], None, {
            "RANK": "3", "WORLD": "4", "PEERS": address, "TOPOLOGY": "star",
            "DEVICE": "cpu", "MESHKIT_SECRET": SECRET.decode()}))

        coordinator.wait_for_workers(timeout=60)
        recorder = Recorder()
        caps = collect_caps(coordinator, plugins=build_manager([recorder], entry_points=False),
                            timeout=30)
        assert [c.rank for c in caps] == [1, 2, 3]
        assert sorted(c.rank for c in recorder.joined) == [1, 2, 3]
        assert caps[1].role == "fixed_function" and caps[1].fixed_function.stage_id == "fpga.mid"

        # A training job including the board rank is refused at placement.
        with pytest.raises(PlacementError, match="rank 2 is a fixed-function rank"):
            place_training(caps)

        stages = [Stage.affine(rng.standard_normal((4, 6)), rng.standard_normal(6),
                               activation="relu"),
                  Stage.board("fpga.mid"),
                  Stage.affine(rng.standard_normal((6, 2)), activation="tanh")]
        xs = [rng.standard_normal(4).astype(np.float32) for _ in range(40)]
        result = run_pipeline(coordinator, stages, caps, xs, in_flight=6, timeout=30)
        with open_board("loopback", board_options) as board:
            expected = run_local(stages, xs, boards={"fpga.mid": board})
        assert len(result.outputs) == len(xs)
        for got, want in zip(result.outputs, expected):
            np.testing.assert_array_equal(got, want)
        assert result.placement.ranks == (1, 2, 3)
        assert [result.reports[r].activations for r in (1, 2, 3)] == [40, 40, 40]

        shutdown_nodes(coordinator)
        outputs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        coordinator.close()

    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err
    advertised = {}
    reports = {}
    for rank, (out, _err) in zip((1, 2, 3), outputs):
        events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        advertised[rank] = NodeCaps.from_json(
            next(e["caps"] for e in events if e["event"] == "caps"))
        reports[rank] = [e["report"] for e in events if e["event"] == "report"]
    # The records the coordinator collected are exactly what each node advertised.
    assert {c.rank: c for c in caps} == advertised
    assert advertised[3].device == "cpu" and advertised[2].devices == ("fpga",)
    assert [r["activations"] for r in reports[2]] == [40]
    assert reports[2][0]["stage_id"] == "fpga.mid"


def test_a_pipeline_over_a_full_mesh_moves_activations_rank_to_rank(tmp_path):
    import threading

    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET)
    secret_file.chmod(0o600)
    peers = [f"127.0.0.1:{p}" for p in free_ports(3)]
    config = NodeConfig(rank=0, world=3, peers=peers, topology="mesh", transport="tcp",
                        secret=SECRET, timeout=20)
    holder: dict = {}
    connecting = threading.Thread(target=lambda: holder.setdefault("g", config.connect()))
    connecting.start()
    common = ["--world", "3", "--peers", ",".join(peers), "--topology", "mesh"]
    procs = [_node(["--rank", str(r), *common], secret_file) for r in (1, 2)]
    try:
        connecting.join(60)
        group = holder["g"]
        caps = collect_caps(group, hook=False, timeout=30)
        stages = [Stage(op="scale", scale=2.0), Stage(op="tanh")]
        xs = [np.linspace(-1, 1, 5, dtype=np.float32) * i for i in range(12)]
        result = run_pipeline(group, stages, caps, xs, in_flight=4, batch=2, timeout=30)
        for got, want in zip(result.outputs, run_local(stages, xs)):
            np.testing.assert_array_equal(got, want)
        shutdown_nodes(group)
        for p in procs:
            p.communicate(timeout=60)
            assert p.returncode == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        if "g" in holder:
            holder["g"].close()


def test_meshkit_node_refuses_to_start_without_a_secret():
    proc = run_cli("node", "--rank", "1", "--world", "2", "--peers", "127.0.0.1:9")
    assert proc.returncode == 2
    assert "no shared secret: a node refuses to join a mesh unauthenticated. Pass " \
           "--secret-file FILE" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_meshkit_node_reports_bad_flags_and_env_values_clearly(tmp_path):
    secret = {"MESHKIT_SECRET": "s" * 16}
    proc = run_cli("node", "--rank", "1", "--world", "4", "--peers", "a:1,b:2", env=secret)
    assert proc.returncode == 2
    assert "peers: got 2 address(es); expected 4 (one per rank, for a mesh) or 1 " \
           "(the coordinator, for a star)" in proc.stderr
    proc = run_cli("node", "--peers", "a:1", env={**secret, "RANK": "x"})
    assert "RANK must be an integer, got 'x'" in proc.stderr
    proc = run_cli("node", "--rank", "1", "--world", "2", "--peers", "a:1", "--board",
                   "loopback", "--board-option", "stage_id=s", "--board-option",
                   "input_elems=many", env=secret)
    assert proc.returncode == 2
    assert "[board] input_elems: expected an integer, got 'many'" in proc.stderr
    proc = run_cli("node", "--rank", "0", "--world", "2", "--peers", "a:1", env=secret)
    assert "rank 0 is the coordinator" in proc.stderr
