"""The worker's side of a fit: with ``clip_norm`` the update leaves the node clipped."""

from __future__ import annotations

import numpy as np
import pytest

import meshkit
from meshkit.aggregation import global_norm
from meshkit.train import Trainer


def _update(trainer_state: dict, fitted: dict) -> dict:
    return {k: fitted[k].astype(np.float64) - trainer_state[k] for k in fitted}


@pytest.mark.parametrize("clip, unclipped", [(1e-3, 0.0), (1e6, 1.0)])
def test_a_fit_with_clip_norm_keeps_its_update_within_it_and_says_if_it_was(clip, unclipped):
    task = meshkit.plugins.create("task", "digits", {"lr": 0.5})
    start = task.init_state(0)
    trainer = Trainer(task)
    trainer.handle({"op": "set_state", "state": start})
    reply = trainer.handle({"op": "fit", "shard": 0, "shards": 10, "seed": 1,
                            "clip_norm": clip, "keep": 0})
    assert "error" not in reply, reply
    assert reply["metrics"]["unclipped"] == unclipped
    kept = trainer.handle({"op": "take", "key": 0})["state"]
    norm = global_norm(_update(start, kept))
    if unclipped:
        assert 0 < norm < clip
    else:
        assert norm == pytest.approx(clip, rel=1e-4)  # clipped, in the model's float32
    plain = Trainer(task)
    plain.handle({"op": "set_state", "state": start})
    assert "unclipped" not in plain.handle({"op": "fit", "shard": 0, "shards": 10,
                                            "seed": 1})["metrics"]
