"""Built-in observers: ``tensorboard`` and ``mlflow``, selected in ``[[observers]]``.

Written as a third-party plugin would be: records and options here, each
observer in its own module, loaded when a factory builds one, so listing
plugins stays fast. An observer is an object implementing meshkit's event
hooks (``meshkit_run_started``, ``meshkit_round_completed``,
``meshkit_run_finished``); the run that selects it calls them, and one that
raises is logged once with its name while training goes on.

* ``tensorboard`` writes TensorBoard event files itself (no TensorBoard or
  TensorFlow needed to write them; the ``tensorboard`` extra installs the
  viewer): every numeric metric per round as a scalar, the config as text.
* ``mlflow`` (extra ``mlflow``) logs to an MLflow tracking store: params from
  the config, metrics per round, the checkpoint and the run's report files
  as artifacts.
"""

from __future__ import annotations

from typing import Any, Iterable

import meshkit

from meshkit_observers.options import MlflowOptions, TensorBoardOptions

__all__ = ["meshkit_observers"]


def _tensorboard(options: TensorBoardOptions) -> Any:
    from meshkit_observers.tensorboard import TensorBoardObserver

    return TensorBoardObserver(options)


def _mlflow(options: MlflowOptions) -> Any:
    from meshkit_observers.mlflow import MlflowObserver

    return MlflowObserver(options)


@meshkit.hookimpl
def meshkit_observers() -> Iterable[meshkit.Component]:
    return [
        meshkit.Component("tensorboard", _tensorboard, TensorBoardOptions,
                          summary="TensorBoard event files: every metric per round, the "
                                  "config as text"),
        meshkit.Component("mlflow", _mlflow, MlflowOptions,
                          summary="an MLflow run: config params, metrics per round, checkpoint "
                                  "and report artifacts (extra mlflow)"),
    ]
