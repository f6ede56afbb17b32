"""Placement by device: ``[strategy] device`` no rank has is refused before any work moves."""

from __future__ import annotations

import pytest

from meshkit import PlacementError
from meshkit.train import Runner, read_metrics

from tests.support.configs import write_config
pytestmark = pytest.mark.slow


def test_a_required_device_no_rank_has_is_refused_before_anything_runs(tmp_path):
    out = tmp_path / "out"
    # The local workers start with --device auto and never import torch: cpu only.
    config = write_config(tmp_path / "c.toml", out, workers=1, rounds=2,
                          extra='device = "cuda"')
    runner = Runner(str(config))
    with pytest.raises(PlacementError, match=r"\[strategy\] device = 'cuda': no worker has "
                                             r"it; they advertise rank 1: cpu\. Start a node "
                                             r"that has it \(meshkit node --device cuda\)"):
        runner.run()
    assert read_metrics(out) == []  # no round ran
    assert runner.report is not None and not runner.report.ok
    assert runner.report.rounds_completed == 0
