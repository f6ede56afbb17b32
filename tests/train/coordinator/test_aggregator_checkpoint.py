"""A stateful aggregator's state is checkpointed with the run and restored by --resume.

Centered clipping carries its centre from round to round; a run stopped
after round 2 and resumed must clip round 3 around the centre round 2 left,
so its final model is the very model of the run that never stopped.
"""

from __future__ import annotations

import numpy as np
import pytest

import meshkit
from tests.support.configs import write_config
from meshkit.checkpoint import load_checkpoint

pytestmark = pytest.mark.slow

AGGREGATOR = '\n[aggregator]\nname = "centered-clipping"\ntau = 0.05\niterations = 2\n'


def _run(tmp_path, name: str, rounds: int, *, out=None, resume=False):
    config = write_config(tmp_path / f"{name}.toml", out or tmp_path / name, workers=2,
                          rounds=rounds, extra=f"clients = 4\n{AGGREGATOR}")
    return meshkit.run(str(config), resume=resume)


def test_a_resumed_run_clips_around_the_centre_it_left(tmp_path):
    straight = _run(tmp_path, "straight", 3)
    first = _run(tmp_path, "stopped", 2, out=tmp_path / "resumed")
    saved = load_checkpoint(tmp_path / "resumed")
    assert saved.round == 2 and saved.aggregator_state["centre"].shape == (2410,)
    assert np.isfinite(saved.aggregator_state["centre"]).all()
    resumed = _run(tmp_path, "resumed", 3, resume=True)
    assert resumed.resumed_from == 2 and first.rounds_completed == 2
    for key, value in straight.state.items():
        np.testing.assert_array_equal(resumed.state[key], value, err_msg=key)
