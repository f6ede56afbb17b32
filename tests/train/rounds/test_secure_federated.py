"""``federated`` under ``[secure_aggregation]`` (plugins/meshkit_strategies/secure.py), in-process:
the plain round's model to within quantisation, outer optimizers and DP composed."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import meshkit
import meshkit.plugins
from meshkit.config import SecureAggregationTable
from meshkit.train import LocalPool, StrategyContext, Trainer

CLIENTS = 8
SECURE = SecureAggregationTable(degree=4, threshold=3, clip_range=1.0, modulus_bits=40)


def task() -> Any:
    return meshkit.plugins.create("task", "synthetic", {"params": 64, "arrays": 2, "rows": 80})


def run(*, secure: Any = SECURE, outer: str = "average", privacy: Any = None,
        **options: Any) -> tuple[Any, list[Any], LocalPool]:
    ranks = [1, 2, 3]
    pool = LocalPool({r: Trainer(task()) for r in ranks})
    reports: list[Any] = []
    ctx = StrategyContext(
        task=task(), aggregator=meshkit.plugins.create("aggregator", "fedavg"), pool=pool,
        workers=ranks, rng=np.random.default_rng(0), seed=3,
        outer=meshkit.plugins.create("outer_optimizer", outer), outer_name=outer,
        timeout=30.0, on_round=lambda report, state: reports.append(report), privacy=privacy,
        secure_aggregation=secure)
    strategy = meshkit.plugins.create("strategy", "federated",
                                      {"rounds": 2, "clients": CLIENTS, **options})
    return strategy.run(ctx), reports, pool


@pytest.mark.parametrize("outer", ["average", "fedadam"])
def test_a_secure_run_steps_the_plain_runs_model_to_within_quantisation(outer):
    secure, reports, pool = run(outer=outer)
    plain, _, _ = run(secure=None, outer=outer)  # equal shards: fedavg is the plain mean
    for key, value in plain.state.items():
        assert secure.state[key].dtype == value.dtype
        # The quantisation step is 2e-11 here: what differs is the float32 rounding of the
        # two means, which fedadam's second round carries on (its steps divide by sqrt(v)).
        np.testing.assert_allclose(secure.state[key], value, atol=1e-6, rtol=1e-5)
    assert [r.round for r in reports] == [1, 2]
    assert all(sorted(r.served) == list(range(CLIENTS)) for r in reports)
    assert "train_loss" not in reports[0].metrics and reports[0].metrics["secure_sum_of"] == 8
    ops = {q["op"] for _, q in pool.log}
    assert "fit" not in ops and "take" not in ops  # no plain fit, no model pulled


def test_dp_clips_on_the_clients_and_noises_the_unmasked_sum():
    privacy = meshkit.plugins.create("privacy", "dp-fixed", {
        "clip_norm": 0.05, "noise_multiplier": 0.5, "clip": "client", "noise": "seeded"})
    result, reports, pool = run(privacy=privacy, sampling="poisson", fraction=1.0)
    masked = [q for _, q in pool.log if q["op"] == "secagg_mask"]
    assert masked and all(q["clip_norm"] == 0.05 for q in masked)
    assert reports[-1].metrics["epsilon"] > 0 and reports[-1].metrics["clip_norm"] == 0.05
    start = task().init_state(3)
    # Two rounds, each moving the model by the mean of updates clipped to S = 0.05 plus the
    # noise, sigma = z S / m = 0.003 a coordinate (64 of them): far less than unclipped fits.
    plain, _, _ = run(secure=None)
    moved, unclipped = (np.sqrt(sum(float(np.sum((s[k].astype(np.float64) - start[k]) ** 2))
                                    for k in start)) for s in (result.state, plain.state))
    assert 0 < moved <= 2 * (0.05 + 4 * 0.5 * 0.05 / CLIENTS * 8) and moved < unclipped
