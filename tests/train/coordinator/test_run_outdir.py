"""A run never loses another run's work: fresh, ``--overwrite``, ``--resume`` of a finished run."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest

import meshkit
from meshkit.checkpoint import load_checkpoint
from meshkit.train import Runner, read_metrics

from tests.support.cli import run_cli
pytestmark = pytest.mark.slow


def config(tmp_path: Path, out: Path, rounds: int = 2, name: str = "c.toml",
           seed: int = 7) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(f"""
        [run]
        seed = {seed}
        out = "{out}"
        [mesh]
        workers = 1
        timeout = 10.0
        [strategy]
        rounds = {rounds}
    """))
    return path


def test_a_fresh_run_into_an_out_dir_holding_a_checkpoint_is_refused_before_it_starts(tmp_path):
    out = tmp_path / "out"
    Runner(str(config(tmp_path, out))).run()
    before = (out / "checkpoint.npz").read_bytes()
    metrics = (out / "metrics.jsonl").read_text()
    log = out / "logs" / "worker-1.log"
    log.write_text("the first run's log\n")
    other = config(tmp_path, out, name="other.toml", seed=8)
    result = run_cli("run", str(other))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    for fragment in ("holds another run's checkpoint", "federated on digits, round 2 of 2",
                     "--resume", "--overwrite", "another [run] out"):
        assert fragment in result.stderr, result.stderr
    assert (out / "checkpoint.npz").read_bytes() == before, "the checkpoint is untouched"
    assert (out / "metrics.jsonl").read_text() == metrics
    assert log.read_text() == "the first run's log\n", "no worker was spawned"
    with pytest.raises(meshkit.ConfigError, match="holds another run's checkpoint"):
        meshkit.run(str(other))


def test_overwrite_replaces_another_runs_checkpoint_explicitly(tmp_path):
    out = tmp_path / "out"
    Runner(str(config(tmp_path, out, rounds=2))).run()
    report = Runner(str(config(tmp_path, out, rounds=1, name="b.toml", seed=8)),
                    overwrite=True).run()
    assert report.ok and report.rounds_completed == 1
    ckpt = load_checkpoint(out)
    assert ckpt.round == 1 and ckpt.identity["seed"] == 8
    assert [r["round"] for r in read_metrics(out)] == [1]


def test_resume_and_overwrite_together_are_refused(tmp_path):
    result = run_cli("run", str(config(tmp_path, tmp_path / "out")), "--resume", "--overwrite")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--resume" in result.stderr and "--overwrite" in result.stderr
    with pytest.raises(meshkit.ConfigError, match="exclude each other"):
        Runner(str(config(tmp_path, tmp_path / "out")), resume=True, overwrite=True).run()


def test_resume_of_a_finished_run_starts_nothing_and_keeps_its_summary(tmp_path):
    out = tmp_path / "out"
    path = config(tmp_path, out, rounds=2)
    first = Runner(str(path)).run()
    summary = (out / "summary.json").read_text()
    assert json.loads(summary)["metrics"]["accuracy"] > 0
    spawned = []
    again = Runner(str(path), resume=True, on_workers=spawned.append).run()
    assert spawned == [], "no worker was spawned"
    assert again.ok and again.already_complete and again.rounds_completed == 2
    assert again.metrics["accuracy"] == pytest.approx(first.metrics["accuracy"])
    assert all(np.array_equal(again.state[k], first.state[k]) for k in first.state)
    assert (out / "summary.json").read_text() == summary, "summary.json's metrics are intact"
    assert [r["round"] for r in read_metrics(out)] == [1, 2]

    result = run_cli("run", str(path), "--resume")
    assert result.returncode == 0, result.stderr
    assert "complete:" in result.stdout and "already holds 2 of 2 round(s)" in result.stdout
    assert "listening" not in result.stdout + result.stderr
    assert (out / "summary.json").read_text() == summary
