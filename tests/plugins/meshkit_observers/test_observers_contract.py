"""The built-in observers pass meshkit's observer contract suite."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from meshkit.testing import ObserverContract


class TestTensorBoard(ObserverContract):
    component = "tensorboard"

    def observer_options(self, tmp_path: Path) -> dict:
        return {"dir": str(tmp_path / "tb")}

    def check_recorded(self, out: Path, tmp_path: Path) -> None:
        files = list((tmp_path / "tb" / "run").glob("events.out.tfevents.*"))
        assert len(files) == 1 and files[0].stat().st_size > 0


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None,
                    reason="the mlflow observer needs the mlflow extra")
class TestMlflow(ObserverContract):
    component = "mlflow"

    def observer_options(self, tmp_path: Path) -> dict:
        return {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}

    def check_recorded(self, out: Path, tmp_path: Path) -> None:
        assert (tmp_path / "mlflow.db").stat().st_size > 0
