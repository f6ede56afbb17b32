"""meshkit-csvlog's tests: its hooks, called through a real plugin manager."""

from __future__ import annotations

import csv
import types

import attrs

from meshkit_csvlog import CsvLogger


@attrs.frozen
class Report:
    round: int
    metrics: dict

    def to_json(self) -> dict:
        return {"round": self.round, "rounds": 2, "strategy": "federated",
                "answered": [1, 2], "dropped": [], "examples": 100, "seconds": 0.5,
                **self.metrics}


def test_each_round_becomes_a_csv_row(meshkit_plugins, tmp_path):
    logger = CsvLogger()
    pset = meshkit_plugins(logger)
    config = types.SimpleNamespace(run=types.SimpleNamespace(out=str(tmp_path / "run")))
    pset.hook.meshkit_run_started(config=config)
    pset.hook.meshkit_round_completed(report=Report(0, {"loss": 0.9, "accuracy": 0.5}))
    pset.hook.meshkit_round_completed(report=Report(1, {"loss": 0.4, "accuracy": 0.8}))
    pset.hook.meshkit_run_finished(report=None)

    with open(tmp_path / "run" / "rounds.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["round"] for r in rows] == ["0", "1"]
    assert rows[1]["loss"] == "0.4" and rows[1]["answered"] == "1 2"


def test_an_unwritable_path_does_not_break_the_run(meshkit_plugins, tmp_path, monkeypatch,
                                                   caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("MESHKIT_CSVLOG", str(blocker / "rounds.csv"))
    pset = meshkit_plugins(CsvLogger())
    pset.hook.meshkit_run_started(config=None)
    pset.hook.meshkit_round_completed(report=Report(0, {"loss": 1.0}))
    assert "cannot write" in caplog.text
