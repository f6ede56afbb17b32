"""A private federated round driven in-process (LocalPool): where the clip bits come from."""

from __future__ import annotations

import math

import numpy as np
import pytest

import meshkit
from meshkit.train import LocalPool, StrategyContext


@pytest.mark.parametrize("placement", ["coordinator", "client"])
def test_adaptive_clipping_moves_s_from_the_bits_wherever_the_clipping_happens(placement):
    task = meshkit.plugins.create("task", "digits", {"lr": 0.5})
    privacy = meshkit.plugins.create("privacy", "dp-adaptive", {
        "clip": placement, "initial_clip_norm": 1e-4, "clip_lr": 0.2, "target_quantile": 0.5,
        "count_noise_multiplier": 1e-3, "noise": "seeded", "accountant": "rdp"})
    reports = []
    ctx = StrategyContext(
        task=task, aggregator=meshkit.plugins.create("aggregator", "fedavg"),
        pool=LocalPool.of(lambda: meshkit.plugins.create("task", "digits", {"lr": 0.5}),
                          (1, 2)),
        workers=[1, 2], rng=np.random.default_rng(0), seed=4, privacy=privacy,
        outer=meshkit.plugins.create("outer_optimizer", "average"),
        on_round=lambda report, state: reports.append(report))
    federated = meshkit.plugins.create("strategy", "federated", {
        "rounds": 3, "clients": 20, "fraction": 0.5, "sampling": "poisson"})
    result = federated.run(ctx)
    clips = [r.metrics["clip_norm"] for r in reports]
    # every update is far above S = 1e-4, so none is within: b ~ 0 and S grows
    # by exp(0.2 * 0.5) a round (the count's noise is 5e-4 wide: negligible)
    for before, after in zip(clips, clips[1:]):
        assert after / before == pytest.approx(math.exp(0.1), rel=1e-3)
    assert privacy.clip_norm == pytest.approx(clips[-1] * math.exp(0.1), rel=1e-3)
    epsilons = [r.metrics["epsilon"] for r in reports]
    assert epsilons == sorted(epsilons) and all(np.isfinite(result.state[k]).all()
                                                 for k in result.state)
