"""Runs from notebooks and scripts: ``meshkit.run`` and ``Runner`` take a path, a mapping or a
parsed config and return the result; ``rounds = 0`` evaluates; a long round says it is alive."""

from __future__ import annotations

import os
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import meshkit
import meshkit.plugins
from meshkit.config import load_config
from meshkit.train import Runner, RunReport, read_metrics

pytestmark = pytest.mark.slow


def table(out: Path, rounds: int = 1, **strategy) -> dict:
    return {"run": {"out": str(out), "seed": 3},
            "mesh": {"workers": 1, "timeout": 10.0},
            "strategy": {"rounds": rounds, **strategy}}


def test_meshkit_run_takes_a_mapping_and_returns_the_runs_report(tmp_path):
    report = meshkit.run(table(tmp_path / "out"))
    assert isinstance(report, RunReport) and report.ok and report.rounds_completed == 1
    assert report.state is not None and set(report.state) == {
        "hidden.w", "hidden.b", "output.w", "output.b"}
    assert [r["round"] for r in read_metrics(tmp_path / "out")] == [1]


def test_a_mapping_with_a_mistake_is_a_config_error_naming_table_and_key(tmp_path):
    bad = table(tmp_path / "out")
    bad["strategy"]["runds"] = 3
    with pytest.raises(meshkit.ConfigError, match=r"<mapping>: \[strategy\] runds"):
        meshkit.run(bad)
    assert not (tmp_path / "out").exists()


def test_runner_takes_a_parsed_config_and_a_path_alike(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(textwrap.dedent(f"""
        [run]
        out = "{tmp_path / 'a'}"
        seed = 3
        [mesh]
        workers = 1
        [strategy]
        rounds = 1
    """))
    by_config = Runner(load_config(path)).run()
    by_path = meshkit.run(path, overwrite=True)
    assert by_config.ok and by_path.ok
    for key in by_config.state:
        assert np.array_equal(by_config.state[key], by_path.state[key])


@pytest.mark.parametrize("strategy", ["federated", "local", "data-parallel"])
def test_rounds_zero_evaluates_the_initial_model_without_starting_a_worker(tmp_path, strategy):
    spawned = []
    out = tmp_path / "out"
    report = Runner(table(out, rounds=0, name=strategy), on_workers=spawned.append).run()
    task = meshkit.plugins.create("task", "digits", {})
    expected = task.evaluate(task.init_state(3))
    assert report.ok and report.rounds == 0 and report.rounds_completed == 0
    assert report.metrics["accuracy"] == pytest.approx(expected["accuracy"])
    assert spawned == [] and not (out / "logs").exists(), "no worker was needed"
    rows = read_metrics(out)
    assert [r["round"] for r in rows] == [0] and rows[0]["loss"] == pytest.approx(
        expected["loss"])
    assert not (out / "checkpoint.npz").exists(), "nothing was trained, nothing to resume"


def test_rounds_zero_of_model_parallel_evaluates_the_state_from_model(tmp_path):
    trained = meshkit.run(table(tmp_path / "trained", rounds=2))
    report = meshkit.run({
        "run": {"out": str(tmp_path / "served"), "seed": 3},
        "mesh": {"workers": 1},
        "strategy": {"name": "model-parallel", "rounds": 0,
                     "state_from": str(tmp_path / "trained"),
                     "partitions": [{"nodes": ["scale", "hidden", "output"], "rank": 1}]}})
    assert report.metrics["accuracy"] == pytest.approx(trained.metrics["accuracy"])


SLOW_FIT = '''
import os
from meshkit_tasks.digits import DigitsTask


class SlowFit(DigitsTask):
    """digits whose fit waits until the test has seen the coordinator report it alive."""

    def fit(self, state, x, y, *, seed):
        with open(os.environ["R2_ALIVE_FIFO"], "rb") as fifo:  # blocks until the test writes
            fifo.read(1)
        return super().fit(state, x, y, seed=seed)
'''


def test_a_long_round_is_reported_alive_while_it_runs(tmp_path, monkeypatch):
    (tmp_path / "slowfit.py").write_text(SLOW_FIT)
    fifo = tmp_path / "alive.fifo"
    os.mkfifo(fifo)
    monkeypatch.setenv("R2_ALIVE_FIFO", str(fifo))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.syspath_prepend(str(tmp_path))
    alive: list[str] = []
    released = threading.Event()

    def progress(event):
        if event.kind == "alive":
            alive.append(event.message)
            if not released.is_set():
                released.set()
                with open(fifo, "wb") as pipe:  # lets the worker's fit return
                    pipe.write(b"x")

    config = table(tmp_path / "out")
    config["run"]["task"] = "slowfit:SlowFit"
    config["mesh"]["timeout"] = 60.0
    report = Runner(config, progress=progress, heartbeat=0.05).run()
    assert report.ok and released.is_set()
    assert alive and alive[0].startswith("round 1/1: still running, ")
    assert "(1 of 1 worker(s) live)" in alive[0]


def test_the_python_api_prints_progress_as_the_cli_does_and_reports_every_round(tmp_path):
    lines: list[str] = []
    report = meshkit.run(table(tmp_path / "out", rounds=2), progress=lambda e: lines.append(
        str(e)))
    rounds = [line for line in lines if line.startswith("round ")]
    assert len(rounds) == 2 and rounds[0].startswith("round   1/2  workers 1/1  train_loss ")
    assert "RunEvent(" not in "".join(lines)
    assert any(line.startswith("rank 1 joined") for line in lines)
    assert [r.round for r in report.history] == [1, 2]
    assert report.history[-1].metrics == report.metrics
    assert str(report).startswith("done: federated, 2 round(s) in ")
