"""The ``tensorboard`` observer: where its event files go and what TensorBoard reads in them."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshkit_observers.options import TensorBoardOptions
from meshkit_observers.tensorboard import TensorBoardObserver


def _accumulator(directory: Path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _play(observer, config, reports, rounds=3):
    Round, Finished = reports
    observer.meshkit_run_started(config=config)
    for r in range(1, rounds + 1):
        observer.meshkit_round_completed(report=Round(r, {"loss": 1.0 / r, "accuracy": r / 4,
                                                          "note": "text is not a curve"}))
    observer.meshkit_run_finished(report=Finished(True, str(config.run.out)))


def test_by_default_the_event_files_go_inside_the_runs_out_dir(run_config, reports):
    observer = TensorBoardObserver(TensorBoardOptions())
    _play(observer, run_config, reports)
    acc = _accumulator(Path(run_config.run.out) / "tensorboard")
    assert [e.step for e in acc.Scalars("accuracy")] == [1, 2, 3]
    assert [e.value for e in acc.Scalars("round/examples")] == [100, 100, 100]
    assert "note" not in acc.Tags()["scalars"]
    (config,) = acc.Tensors("config")
    assert '"strategy.rounds": 3' in config.tensor_proto.string_val[0].decode()


def test_with_dir_each_run_has_its_own_directory(run_config, reports, tmp_path):
    observer = TensorBoardObserver(TensorBoardOptions(dir=str(tmp_path / "tb")))
    _play(observer, run_config, reports, rounds=2)
    acc = _accumulator(tmp_path / "tb" / "run")
    assert [e.step for e in acc.Scalars("loss")] == [1, 2]
