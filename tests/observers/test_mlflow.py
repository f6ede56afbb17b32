"""The ``mlflow`` observer, against a real MLflow file store, read back with MLflow's client."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from meshkit_observers.options import MlflowOptions

pytest.importorskip("mlflow")
pytestmark = pytest.mark.usefixtures("no_mlflow_opt_in")


def _client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def test_params_metrics_and_artifacts_reach_the_default_local_store(run_config, reports):
    Round, Finished = reports
    from meshkit_observers.mlflow import MlflowObserver

    out = Path(run_config.run.out)
    observer = MlflowObserver(MlflowOptions(experiment="digits"))
    observer.meshkit_run_started(config=run_config)
    for r in (1, 2, 3):
        observer.meshkit_round_completed(report=Round(r, {"accuracy": r / 4}))
    (out / "summary.json").write_text("{}")
    (out / "checkpoint.npz").write_bytes(b"npz")
    observer.meshkit_run_finished(report=Finished(True, str(out)))

    assert observer.tracking_uri == (out / "mlruns").absolute().as_uri()
    assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"  # the default store's opt-in
    client = _client(observer.tracking_uri)
    run = client.get_run(observer.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["strategy.rounds"] == "3"
    assert run.data.params["task.hidden"] == "16"
    history = client.get_metric_history(observer.run_id, "accuracy")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.25), (2, 0.5), (3, 0.75)]
    artifacts = {a.path for a in client.list_artifacts(observer.run_id)}
    assert {"config.toml", "summary.json", "checkpoint.npz"} <= artifacts


def test_a_failed_run_is_marked_failed(run_config, reports, tmp_path):
    _, Finished = reports
    from meshkit_observers.mlflow import MlflowObserver

    uri = (tmp_path / "elsewhere").as_uri()
    observer = MlflowObserver(MlflowOptions(tracking_uri=uri, run_name="attempt"))
    observer.meshkit_run_started(config=run_config)
    observer.meshkit_run_finished(report=Finished(False, str(run_config.run.out)))
    assert _client(uri).get_run(observer.run_id).info.status == "FAILED"
