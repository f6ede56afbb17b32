"""``[[observers]]``: trackers a config selects, told the run's events, never stopping it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import meshkit
from meshkit import ConfigError, UnknownComponentError
from meshkit.config import parse_config
from meshkit.train._coordinator.plan import resolve
from meshkit.plugins import build_manager
from meshkit.train import Runner
from meshkit.train._coordinator.observers import build_observers
from tests.support.cli import run_cli
from tests.support.configs import write_config


def _config(tmp_path: Path, observers: list[dict]) -> dict:
    return {"run": {"out": str(tmp_path / "run")}, "observers": observers}


class Flaky:
    """An observer whose every round raises."""

    def __init__(self) -> None:
        self.started = 0

    @meshkit.hookimpl
    def meshkit_run_started(self, config):
        self.started += 1

    @meshkit.hookimpl
    def meshkit_round_completed(self, report):
        raise OSError("the dashboard is down")


class Deaf:
    """An observer object with no event hook a run delivers (node_joined fires below the run)."""

    @meshkit.hookimpl
    def meshkit_node_joined(self, caps):  # pragma: no cover - never called
        pass


class Offering:
    def __init__(self, observer) -> None:
        self.observer = observer

    @meshkit.hookimpl
    def meshkit_observers(self):
        return [meshkit.Component("flaky", lambda: self.observer)]


def _pset(observer):
    return build_manager({"test-observers": Offering(observer)})


def test_each_observers_entry_is_resolved_in_order(tmp_path):
    plan = resolve(parse_config(_config(tmp_path, [
        {"name": "tensorboard", "dir": str(tmp_path / "tb")}, {"name": "mlflow"}])))
    assert [c.name for c, _ in plan.observers] == ["tensorboard", "mlflow"]
    assert plan.observers[0][1].dir == str(tmp_path / "tb")
    assert any(line.startswith("observer: tensorboard from plugin 'observers'")
               for line in plan.describe())


def test_check_lists_the_observers_and_refuses_an_unknown_one(tmp_path):
    config = write_config(tmp_path / "job.toml", tmp_path / "run", extra=(
        '[[observers]]\nname = "tensorboard"\ndir = "tb"\n'))
    checked = run_cli("check", str(config), "--json")
    assert checked.returncode == 0, checked.stderr
    assert json.loads(checked.stdout)["observers"] == [
        {"name": "tensorboard", "plugin": "observers", "options": {"dir": "tb"}}]
    config.write_text(config.read_text().replace('name = "tensorboard"', 'name = "tensorbord"'))
    refused = run_cli("check", str(config))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "[[observers]] #1 name = 'tensorbord'" in refused.stderr


def test_an_unknown_observer_names_the_entry(tmp_path):
    config = parse_config(_config(tmp_path, [{"name": "tensorboard"}, {"name": "wandb"}]))
    with pytest.raises(UnknownComponentError, match=r"\[\[observers\]\] #2 name = 'wandb'.*"
                                                    r"tensorboard"):
        resolve(config)


def test_an_unknown_option_names_the_entry_and_key(tmp_path):
    config = parse_config(_config(tmp_path, [{"name": "tensorboard", "logdir": "x"}]))
    with pytest.raises(ConfigError, match=r"\[\[observers\]\] #1.*logdir"):
        resolve(config)


@pytest.mark.parametrize("value, message", [
    ({"name": "tensorboard"}, "expected an array of tables"),
    ([{"dir": "x"}], r"#1 name: expected an observer name"),
])
def test_a_malformed_observers_table_is_refused(tmp_path, value, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"observers": value})


def test_an_observer_that_hears_nothing_is_refused(tmp_path):
    plan = resolve(parse_config(_config(tmp_path, [{"name": "flaky"}])), _pset(Deaf()))
    with pytest.raises(ConfigError, match="implements none of the run's event hooks"):
        build_observers(plan)


@pytest.mark.slow
def test_an_observer_that_fails_is_reported_once_and_the_run_goes_on(tmp_path, caplog):
    flaky = Flaky()
    config = write_config(tmp_path / "job.toml", tmp_path / "run", workers=1, rounds=2,
                          extra='[[observers]]\nname = "flaky"\n')
    caplog.set_level(logging.WARNING, logger="meshkit.plugins")
    report = Runner(str(config), pset=_pset(flaky)).run()
    assert report.ok and report.rounds_completed == 2
    assert flaky.started == 1
    warnings = [r for r in caplog.records if "the dashboard is down" in r.getMessage()]
    assert len(warnings) == 1 and "'flaky'" in warnings[0].getMessage()


@pytest.mark.slow
def test_a_run_logs_every_round_to_tensorboard_and_mlflow(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    config = write_config(tmp_path / "job.toml", out, workers=1, rounds=3, extra=(
        '[[observers]]\nname = "tensorboard"\n\n'
        '[[observers]]\nname = "mlflow"\nexperiment = "digits"\n'))
    ran = run_cli("run", str(config), "-q", timeout=180)
    assert ran.returncode == 0, ran.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    expected = [(row["round"], row["accuracy"]) for row in rows]
    assert [r for r, _ in expected] == [1, 2, 3]

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("accuracy")] == [
        (r, pytest.approx(a, rel=1e-6)) for r, a in expected]
    assert 'name = "federated"' in acc.Tensors("config")[0].tensor_proto.string_val[0].decode()

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads a file store so
    client = MlflowClient(tracking_uri=(out / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("digits").experiment_id])
    history = client.get_metric_history(run.info.run_id, "accuracy")
    assert sorted((m.step, m.value) for m in history) == expected
    assert run.data.params["strategy.rounds"] == "3" and run.info.status == "FINISHED"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"checkpoint.npz", "metrics.jsonl", "summary.json", "config.toml"} <= artifacts
