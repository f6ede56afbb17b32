"""One hostile rank among five real ``meshkit node`` processes: every round finishes.

The hostile node runs :mod:`tests.support.hostile_task` with its own
``--task-option misbehave=...`` (a different breach each round); the other
four are honest. Every round completes, the hostile rank is named with its
reason in the round's ``failed`` (and ``summary.json``), and because a fit
is a pure function of (model, client, seed) the clients it failed are served
again by the honest ranks: the final model equals, bit for bit, a run on four
honest nodes alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.configs import write_secret_file
from tests.support.nodes import finish, spawn_node

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
SECRET = b"hostile-rank-secret-0123456789abcdef"
HOSTILE = 5  # the last of five workers


def config(tmp_path: Path, name: str, *, workers: int, clients: int, rounds: int,
           aggregator: str = "fedavg") -> Path:
    secret = write_secret_file(tmp_path / "secret", SECRET)
    path = tmp_path / f"{name}.toml"
    path.write_text(f"""
[run]
task = "tests.support.hostile_task:Hostile"
seed = 3
out = "{tmp_path / name}"

[mesh]
launch = "external"
workers = {workers}
bind = "127.0.0.1:0"
secret_file = "{secret}"
timeout = 4
join_timeout = 60

[strategy]
name = "federated"
rounds = {rounds}
clients = {clients}

[aggregator]
name = "{aggregator}"
""")
    return path


def run(path: Path, workers: int, hostile: str = "") -> Any:
    """Run ``path`` here over ``workers`` node processes; the last misbehaves as ``hostile``."""
    from meshkit.train import Runner

    listening: list[str] = []
    ready = threading.Event()
    outcome: dict[str, Any] = {}

    def progress(event: Any) -> None:
        if event.kind == "listening":
            listening.append(event.message.split()[3])
            ready.set()

    def drive() -> None:
        try:
            outcome["report"] = Runner(str(path), progress=progress).run()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            outcome["error"] = exc
        ready.set()

    coordinator = threading.Thread(target=drive, daemon=True)
    coordinator.start()
    assert ready.wait(60) and listening, outcome.get("error")
    procs = []
    for rank in range(1, workers + 1):
        extra = ["--task-option", f"misbehave={hostile}"] if hostile and rank == workers else []
        procs.append(spawn_node(rank, workers + 1, listening[0], path.parent / "secret", *extra))
    try:
        coordinator.join(240)
        assert not coordinator.is_alive(), "the run did not finish"
        for rank, proc in enumerate(procs, 1):
            if hostile and rank == workers:
                continue  # dropped, quarantined or stalled: its exit is not the point
            _, err = finish(proc, 60)
            assert proc.returncode == 0, err
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                finish(proc, 10)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["report"]


@pytest.fixture(autouse=True)
def _importable(monkeypatch):
    # The nodes import the hostile task by module reference, as a user's would.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))


def rows(report: Any) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (Path(report.out) / "metrics.jsonl").read_text()
            .splitlines()]


def same_model(a: Any, b: Any) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert np.asarray(a[key]).tobytes() == np.asarray(b[key]).tobytes(), key


@pytest.mark.parametrize("clients, modes, why", [
    # One client a worker: the flat engine, each contribution checked at the boundary.
    (5, "nan+scalar+shape", ["holds NaN or inf", "is an array float64[]",
                             "is an array float64[65, 32]"]),
    # Two a worker: the batched round (each worker folds its own clients exactly).
    (10, "error+inf+hang", ["hostile node: this fit refuses", "sent NaN or inf", None]),
], ids=["flat", "batched"])
def test_one_hostile_rank_among_five_costs_only_its_own_rank(tmp_path, clients, modes, why):
    honest = run(config(tmp_path, "honest", workers=4, clients=clients, rounds=4), 4)
    hostile = run(config(tmp_path, "hostile", workers=5, clients=clients, rounds=4), 5, modes)
    assert hostile.ok and hostile.rounds_completed == 4, hostile.error
    lines = rows(hostile)
    assert [line["round"] for line in lines] == [1, 2, 3, 4]
    for line in lines:
        # Every client of every round was served, by an honest rank.
        assert line["not_served"] == {} and sorted(map(int, line["served"])) == \
            list(range(clients)), line
    for line, expected in zip(lines, why):
        if expected is None:  # the hang: the pool's deadline declares it dead
            assert line["failed"] == {} and line["dropped"] == [HOSTILE], line
        else:
            assert list(line["failed"]) == [str(HOSTILE)] and expected in \
                line["failed"][str(HOSTILE)], line
    summary = json.loads((Path(hostile.out) / "summary.json").read_text())
    assert summary["ok"] is True
    if modes.endswith("hang"):
        assert "no reply" in summary["dropped"][str(HOSTILE)] or \
            "stall" in summary["dropped"][str(HOSTILE)], summary["dropped"]
        assert len(summary["failed"][str(HOSTILE)]) == 2
    else:
        # Failing in three rounds is quarantine: it sits out the fourth.
        assert summary["dropped"][str(HOSTILE)].startswith("quarantined: failed in 3 rounds")
        assert lines[2]["dropped"] == [HOSTILE] and lines[3]["failed"] == {}
        assert [entry.split(":")[0] for entry in summary["failed"][str(HOSTILE)]] == \
            ["round 1", "round 2", "round 3"]
    same_model(hostile.state, honest.state)


def test_a_finite_but_huge_contribution_is_legal_and_a_robust_rule_outvotes_it(tmp_path):
    # 1e308 is finite: no breach (docs/strategies.md, "Out of range is the aggregator's to
    # say"). Under median the one hostile rank of five moves nothing out of range.
    hostile = run(config(tmp_path, "huge", workers=5, clients=5, rounds=3,
                         aggregator="median"), 5, "huge+huge+huge")
    assert hostile.ok and hostile.rounds_completed == 3, hostile.error
    for line in rows(hostile):
        assert line["failed"] == {} and line["not_served"] == {} and line["dropped"] == []
        assert HOSTILE in line["served"].values()
    for key, value in hostile.state.items():
        assert np.isfinite(value).all() and np.abs(value).max() < 10, key
