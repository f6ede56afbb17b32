"""A worker's own floor on the distributed-DP noise (``meshkit node --min-noise-multiplier``).

The coordinator plans each distributed round's Skellam variance; a coordinator that asked
for less than the config's would get a sum with less noise. A worker given a floor refuses
such a masking request before its clients train, and plays an honest one. The
round is real: :func:`~meshkit.train.secure_sum` over in-process trainers behind a
:class:`~meshkit.train.LocalPool` (tests/train/rounds/test_secure_round.py's).
"""

from __future__ import annotations

from typing import Any

import pytest

from meshkit.errors import WorkerError
from meshkit.privacy import field_levels, plan_skellam
from meshkit.train import Signing, Trainer
from tests.train.rounds.test_secure_round import CLIENTS, context, play, task

CLIP = 1.0


def planner(z: float) -> Any:
    """What the coordinator's ``noise`` hook plans for the round, at noise multiplier z."""
    def plan(params: Any, length: int) -> Any:
        return plan_skellam(clip_norm=CLIP, noise_multiplier=z, cohort=params.clients,
                            length=length, levels=field_levels(params.modulus_bits,
                                                               params.clients),
                            bits=params.modulus_bits)
    return plan


def workers(floor: float) -> dict[int, Trainer]:
    out = {r: Trainer(task()) for r in range(1, 6)}
    for trainer in out.values():
        trainer.secure.signing = Signing(min_noise_multiplier=floor)
    return out


def test_a_worker_refuses_a_round_planned_with_less_noise_than_its_floor():
    ctx = context(5, trainers=workers(1.0))
    with pytest.raises(WorkerError, match=r"noise multiplier 0\.5, below the 1 this node "
                                          r"accepts.*noise_multiplier >= 1"):
        play(ctx, fit={"clip_norm": CLIP}, noise=planner(0.5), accept_failures=False)
    masks = [q for _, q in ctx.pool.log if q["op"] == "secagg_mask"]
    assert masks and all(q["ddp_variance"] > 0 for q in masks)  # it was asked, and said no


def test_a_worker_plays_a_round_planned_at_or_above_its_floor():
    for z in (1.0, 1.5):
        ctx = context(5, trainers=workers(1.0))
        _, revealed = play(ctx, fit={"clip_norm": CLIP}, noise=planner(z),
                           accept_failures=False)
        assert revealed.contributors == tuple(range(CLIENTS))
        assert revealed.noise is not None


def test_without_a_floor_the_worker_checks_nothing():
    ctx = context(5, trainers=workers(0.0))
    _, revealed = play(ctx, fit={"clip_norm": CLIP}, noise=planner(0.5), accept_failures=False)
    assert revealed.contributors == tuple(range(CLIENTS))
