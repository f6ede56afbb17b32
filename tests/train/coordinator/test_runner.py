"""The runner without worker processes: how a failed run is reported, and what resume accepts."""

from __future__ import annotations

import json
import textwrap

import pytest

import meshkit
import meshkit.plugins
from meshkit.checkpoint import Checkpoint, save_checkpoint
from meshkit.train._coordinator.plan import check
from meshkit.errors import ConfigError
from meshkit.train import Runner, build_components, read_metrics
from meshkit.train._coordinator.resume import identity, prepare_out


def write(tmp_path, text: str, name: str = "c.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_a_run_that_dies_of_a_non_mesh_error_is_not_reported_ok(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHKIT_SECRET", "x" * 32)
    out = tmp_path / "out"
    path = write(tmp_path, f"""
        [run]
        out = "{out}"
        [mesh]
        launch = "external"
        bind = "127.0.0.1:0"
        workers = 1
    """)
    finished = []

    class Watch:
        @meshkit.hookimpl
        def meshkit_run_finished(self, report):
            finished.append(report)

    pset = meshkit.plugins.build_manager(plugins={"watch": Watch()})

    def progress(event):
        raise RuntimeError("a bug in a progress callback")

    with pytest.raises(RuntimeError, match="a bug in a progress callback"):
        Runner(str(path), pset=pset, progress=progress).run()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is False
    assert "RuntimeError: a bug in a progress callback" in summary["error"]
    assert finished and finished[-1].ok is False


def _resume_fixture(tmp_path, metrics_rounds):
    out = tmp_path / "out"
    path = write(tmp_path, f"""
        [run]
        out = "{out}"
        [strategy]
        rounds = 4
    """)
    plan = check(path)
    parts = build_components(plan)
    state = parts["task"].init_state(0)
    line = {"round": 2, "rounds": 4, "strategy": "federated", "answered": [1, 2],
            "accuracy": 0.5}
    save_checkpoint(out, Checkpoint(round=2, state=state, identity=identity(plan),
                                    rng_state=parts["rng"].bit_generator.state, report=line))
    (out / "metrics.jsonl").write_text("".join(
        json.dumps({**line, "round": r}) + "\n" for r in metrics_rounds))
    start = prepare_out(plan, parts, resume=True)
    assert (start.round, start.resumed, start.complete) == (2, True, False)
    return read_metrics(out)


def test_a_crash_between_checkpoint_and_metrics_line_leaves_no_gap_after_resume(tmp_path):
    rows = _resume_fixture(tmp_path, metrics_rounds=[1])
    assert [r["round"] for r in rows] == [1, 2]
    assert rows[1]["accuracy"] == 0.5


def test_resume_neither_duplicates_nor_keeps_rounds_past_the_checkpoint(tmp_path):
    rows = _resume_fixture(tmp_path, metrics_rounds=[1, 2, 3])
    assert [r["round"] for r in rows] == [1, 2]


def test_resume_refuses_a_checkpoint_whose_model_does_not_fit_the_task_options(tmp_path):
    out = tmp_path / "out"
    made = check(write(tmp_path, f'[run]\nout = "{out}"\n[task]\nhidden = 32\n', "a.toml"))
    parts = build_components(made)
    save_checkpoint(out, Checkpoint(round=1, state=parts["task"].init_state(0),
                                    identity=identity(made)))
    changed = check(write(tmp_path, f'[run]\nout = "{out}"\n[task]\nhidden = 64\n', "b.toml"))
    with pytest.raises(ConfigError) as err:
        prepare_out(changed, build_components(changed), resume=True)
    message = str(err.value)
    assert "does not fit the task this config builds" in message
    assert "hidden.w: checkpoint shape (64, 32), this config's task (64, 64)" in message
