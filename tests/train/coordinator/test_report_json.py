"""What a round and a run report: the metrics.jsonl line and the summary.json form."""

from __future__ import annotations

import json

import numpy as np

from meshkit.train import RoundReport, RunReport


def test_a_metric_named_like_a_report_field_is_kept_beside_it_not_over_it():
    report = RoundReport(round=3, rounds=5, strategy="federated", answered=(1, 2),
                         examples=640, seconds=1.25,
                         metrics={"examples": 600.0, "round": 9.0, "loss": 0.5})
    line = report.to_json()
    assert line["examples"] == 640 and line["round"] == 3
    assert line["task.examples"] == 600.0 and line["task.round"] == 9.0
    assert line["loss"] == 0.5


def test_a_run_report_with_numpy_metrics_still_writes_its_summary():
    report = RunReport(ok=True, out="o", strategy="federated", rounds=1, rounds_completed=1,
                       metrics={"loss": np.float32(0.5), "accuracy": np.float64(0.75)})
    assert json.loads(json.dumps(report.to_json()))["metrics"] == {"loss": 0.5,
                                                                    "accuracy": 0.75}
