"""Options (the ``[[observers]]`` keys) of the built-in observers: attrs only."""

from __future__ import annotations

import attrs

__all__ = ["TensorBoardOptions", "MlflowOptions"]


@attrs.frozen
class TensorBoardOptions:
    """``[[observers]] name = "tensorboard"``."""

    #: Where the event files go: ``DIR/<run name>/`` (the run name is the last
    #: part of ``[run] out``), so one ``tensorboard --logdir DIR`` shows every
    #: run. Empty: ``<[run] out>/tensorboard/``.
    dir: str = ""


@attrs.frozen
class MlflowOptions:
    """``[[observers]] name = "mlflow"``."""

    #: An MLflow tracking URI (``http://host:5000``, ``sqlite:///mlflow.db``,
    #: ``file:/path``). Empty: a local file store, ``file:<[run] out>/mlruns``.
    tracking_uri: str = ""
    #: The MLflow experiment the run is logged under (created if missing).
    experiment: str = "meshkit"
    #: The MLflow run's name. Empty: the last part of ``[run] out``.
    run_name: str = ""
