"""``fedbuff`` end to end with real processes: a kill mid-buffer and ``--resume`` on the
virtual clock, and a real straggler node on real time."""

from __future__ import annotations

import signal

import numpy as np
import pytest

from meshkit.checkpoint import load_checkpoint
from meshkit.train import read_metrics
from meshkit_strategies.fedbuff import staleness_weight

from tests.support.cli import run_cli
from tests.support.configs import KILLER, external_config, write_config
from tests.support.nodes import run_with_nodes, spawn_node

pytestmark = pytest.mark.slow

FEDBUFF = """clients = 24
buffer_size = 3
concurrency = 5

[partitioner]
name = "dirichlet"
alpha = 0.5

[simulation]
clock = "virtual"
sigma = 1.0

[task]
hidden = 16
"""


def test_a_kill_mid_buffer_and_resume_reach_the_uninterrupted_runs_bits(tmp_path):
    (tmp_path / "killer.py").write_text(KILLER)
    straight = write_config(tmp_path / "straight.toml", tmp_path / "straight", rounds=10,
                            task="killer:Killer", strategy="fedbuff", extra=FEDBUFF,
                            outer="fedavgm", workers=2)
    crashed = write_config(tmp_path / "crashed.toml", tmp_path / "crashed", rounds=10,
                           task="killer:Killer", strategy="fedbuff", extra=FEDBUFF,
                           outer="fedavgm", workers=2)
    env = {"PYTHONPATH": str(tmp_path)}
    first = run_cli("run", str(crashed), cwd=str(tmp_path), timeout=120,
                    env={**env, "KILL_AT_FIT": "12", "KILL_MARK": str(tmp_path / "killed")})
    assert first.returncode == -signal.SIGKILL, first.stderr
    killed_after = load_checkpoint(tmp_path / "crashed").round
    assert 1 <= killed_after < 10
    resumed = run_cli("run", str(crashed), "--resume", cwd=str(tmp_path), timeout=120, env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed after round {killed_after}" in resumed.stdout
    whole = run_cli("run", str(straight), cwd=str(tmp_path), timeout=120, env=env)
    assert whole.returncode == 0, whole.stderr
    # Both workers live all along: every step's line says so (issue 35, item 9).
    steps = [line for line in whole.stdout.splitlines() if line.startswith("round ")]
    assert len(steps) == 10 and all("workers 2/2 live, 3 update(s) from rank" in line
                                    for line in steps), whole.stdout
    a, b = load_checkpoint(tmp_path / "crashed"), load_checkpoint(tmp_path / "straight")
    assert a.round == b.round == 10
    for key in b.state:
        assert np.array_equal(a.state[key], b.state[key]), key
    rows_a, rows_b = read_metrics(tmp_path / "crashed"), read_metrics(tmp_path / "straight")
    assert [r["round"] for r in rows_a] == list(range(1, 11))
    for field in ("clients", "staleness", "simulated_time", "client_weights"):
        assert [r[field] for r in rows_a] == [r[field] for r in rows_b], field
    assert any(int(t) > 0 for r in rows_b for t in r["staleness"])


SECRET = b"fedbuff-straggler-secret-0123456789"


def test_a_slow_nodes_updates_reach_the_model_weighted_by_their_staleness(tmp_path):
    config = external_config(tmp_path, workers=4, rounds=16, secret=SECRET,
                             strategy="fedbuff", extra="""
        clients = 16
        buffer_size = 2
        concurrency = 4

        [task]
        fit_delay = 0.03
    """)
    secret = tmp_path / "secret"
    # Rank 4 takes five times as long over every fit (0.15 s against 0.03 s).
    slow = ["--task-option", "fit_delay=0.15"]

    def nodes(address: str) -> list:
        return [spawn_node(rank, 5, address, secret, *(slow if rank == 4 else []))
                for rank in (1, 2, 3, 4)]

    report = run_with_nodes(config, nodes, timeout=120)
    assert report.ok and report.dropped == {}
    rows = read_metrics(tmp_path / "out")
    slow_updates = [(row, client) for row in rows for client, rank in row["served"].items()
                    if rank == 4]
    # The fast nodes kept stepping the model while it trained: it contributed, and late.
    assert slow_updates
    assert any(row["client_staleness"][c] >= 1 for row, c in slow_updates)
    for row in rows:
        mass = sum(row["client_examples"].values())
        for client, tau in row["client_staleness"].items():
            expected = row["client_examples"][client] * staleness_weight("sqrt", tau) / mass
            assert row["client_weights"][client] == pytest.approx(expected, rel=1e-12)
        assert sum(row["staleness"].values()) == 2 and "simulated_time" not in row
