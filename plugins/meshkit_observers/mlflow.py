"""The ``mlflow`` observer: one MLflow run per meshkit run (extra ``mlflow``).

At ``meshkit_run_started`` it creates a run in ``experiment`` (created if
missing) of the tracking store at ``tracking_uri`` and logs the config as
params (``run.seed``, ``strategy.rounds``, ``task.hidden``, ...) and as the
artifact ``config.toml``; after each round, every finite numeric metric at
``step = round``; at ``meshkit_run_finished``, the run directory's
``checkpoint.npz``, ``metrics.jsonl``, ``summary.json`` and ``report.png``
(those that exist) as artifacts, and the run's status (FINISHED or FAILED).

The default store is a local file store, ``file:<[run] out>/mlruns``
(``mlflow ui --backend-store-uri file:runs/x/mlruns`` shows it). MLflow 3
keeps its file store in maintenance mode and refuses it unless
``MLFLOW_ALLOW_FILE_STORE`` is true; for a ``file:`` URI this observer sets
that variable when it is unset (the user's own setting wins). A database
(``sqlite:///...``) or a tracking server is MLflow's recommendation for
anything long-lived; give it as ``tracking_uri``.

It uses :class:`mlflow.MlflowClient` only, never the fluent ``mlflow.*``
API, whose one global active run would tie two runs in one process together.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import meshkit

from meshkit_observers.options import MlflowOptions
from meshkit_observers.run_facts import config_params, config_text, round_scalars, run_name

__all__ = ["MlflowObserver", "ARTIFACTS"]

log = logging.getLogger(__name__)

#: The run directory's files logged as artifacts at the end, those that exist.
ARTIFACTS = ("checkpoint.npz", "metrics.jsonl", "summary.json", "report.png")

#: MLflow's own limit on a param value's length (longer ones are cut, saying so).
MAX_PARAM = 6000


class MlflowObserver:
    """An MLflow run for the meshkit run that selected it."""

    def __init__(self, options: MlflowOptions) -> None:
        if importlib.util.find_spec("mlflow") is None:
            raise meshkit.ConfigError(
                "the mlflow observer needs MLflow, which is not installed; install the "
                "extra: pip install 'meshkit[mlflow]' (or mlflow / mlflow-skinny)")
        self.options = options
        self._lock = threading.Lock()
        self._client: Any = None
        self.run_id: str | None = None
        self.tracking_uri = ""

    @meshkit.hookimpl
    def meshkit_run_started(self, config: Any) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        out = Path(str(config.run.out)).absolute()
        uri = self.options.tracking_uri or (out / "mlruns").as_uri()
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        with self._lock:
            self.tracking_uri = uri
            client = MlflowClient(tracking_uri=uri)
            experiment = client.get_experiment_by_name(self.options.experiment)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else client.create_experiment(self.options.experiment))
            run = client.create_run(experiment_id,
                                    run_name=self.options.run_name or run_name(config),
                                    tags={"meshkit.out": str(out)})
            self._client, self.run_id = client, run.info.run_id
            params = [Param(key, _param_value(value))
                      for key, value in sorted(config_params(config).items())]
            for start in range(0, len(params), 100):  # MLflow takes at most 100 per batch
                client.log_batch(self.run_id, params=params[start:start + 100])
            with tempfile.TemporaryDirectory() as tmp:
                text = Path(tmp) / "config.toml"
                text.write_text(config_text(config), encoding="utf-8")
                client.log_artifact(self.run_id, str(text))

    @meshkit.hookimpl
    def meshkit_round_completed(self, report: Any) -> None:
        from mlflow.entities import Metric

        with self._lock:
            if self._client is None or self.run_id is None:
                raise RuntimeError("a round completed before meshkit_run_started created the "
                                   "MLflow run")
            now = int(time.time() * 1000)
            metrics = [Metric(key, value, now, int(report.round))
                       for key, value in round_scalars(report).items()]
            self._client.log_batch(self.run_id, metrics=metrics)

    @meshkit.hookimpl
    def meshkit_run_finished(self, report: Any) -> None:
        with self._lock:
            client, run_id = self._client, self.run_id
            self._client = None
            if client is None or run_id is None:
                return
            out = Path(str(report.out))
            for name in ARTIFACTS:
                if (out / name).is_file():
                    client.log_artifact(run_id, str(out / name))
            client.set_terminated(run_id, status="FINISHED" if report.ok else "FAILED")


def _param_value(value: Any) -> str:
    text = str(value)
    if len(text) > MAX_PARAM:
        log.warning("mlflow: a param of %d characters was cut to MLflow's %d", len(text),
                    MAX_PARAM)
        return text[:MAX_PARAM]
    return text
