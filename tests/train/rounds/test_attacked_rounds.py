"""Simulated attacks in the round engine: who is poisoned, how, and that it is recorded."""

from __future__ import annotations

import json

import numpy as np
import pytest

import meshkit
from meshkit import ConfigError
from meshkit.attack import AttackRound, attack_rng, tamper_contribution
from meshkit.config import parse_config
from meshkit.train import (AttackPlan, LocalPool, StrategyContext, Trainer, Work, client_seed,
                           fold_round)

SYNTHETIC = {"params": 64, "arrays": 2, "rows": 64}


def synthetic():
    return meshkit.plugins.create("task", "synthetic", SYNTHETIC)


def plan(name: str, clients, **options) -> AttackPlan:
    return AttackPlan(name=name, options=options,
                      attack=meshkit.plugins.create("attack", name, options),
                      clients=tuple(clients), seed=7)


def ctx_for(attack=None, aggregator="fedavg", task=synthetic, trainers=None):
    ranks = [1, 2]
    pool = LocalPool(trainers or {r: Trainer(task()) for r in ranks})
    return StrategyContext(task=task(), aggregator=meshkit.plugins.create("aggregator",
                                                                          aggregator),
                           pool=pool, workers=ranks, rng=np.random.default_rng(0), seed=7,
                           attack=attack, timeout=30.0)


def fits(clients: int, rnd: int = 1) -> list[Work]:
    return [Work(c, {"op": "fit", "shard": c, "shards": clients,
                     "seed": client_seed(7, rnd, c)}) for c in range(clients)]


def honest_fits(ctx, state, clients):
    """Each client's honest contribution, fitted directly."""
    task = synthetic()
    x, y = task.train_data()
    from meshkit.train import shard_pair
    xs, ys = shard_pair(x, y, clients)
    return [task.fit(state, xs[c], ys[c], seed=client_seed(7, 1, c)) for c in range(clients)]


def test_only_the_chosen_clients_are_poisoned_and_each_is_recorded():
    ctx = ctx_for(plan("sign-flip", [1], factor=2.0))
    state = ctx.task.init_state(0)
    folded = fold_round(ctx, fits(4), state=state)
    assert folded.attacked == (1,)
    honest = honest_fits(ctx, state, 4)
    contributions = [r.state for r in honest]
    contributions[1] = tamper_contribution(
        ctx.attack.attack, contributions[1], state,
        AttackRound(client=1, contributors=4, attackers=1, rng=attack_rng(7, 0)))
    weights = [r.examples for r in honest]
    for key in state:
        expected = sum(w * c[key].astype(np.float64) for w, c in zip(weights, contributions))
        np.testing.assert_allclose(folded.result[key], expected / sum(weights), rtol=1e-6)
    report = folded.outcome(folded.result, {})
    assert report.attacked == (1,)


def test_an_omniscient_attack_sees_the_honest_updates_of_the_round():
    ctx = ctx_for(plan("ipm", [0, 3], epsilon=1.0), aggregator="allreduce")
    state = ctx.task.init_state(0)
    folded = fold_round(ctx, fits(4), state=state, weight=lambda reply: 1.0)
    honest = honest_fits(ctx, state, 4)
    mean_update = {k: np.mean([honest[c].state[k].astype(np.float64) - state[k]
                               for c in (1, 2)], axis=0) for k in state}
    # Two honest updates u and two copies of -u: the mean update is zero.
    for key in state:
        np.testing.assert_allclose(folded.result[key], state[key], atol=1e-6)
        assert np.abs(mean_update[key]).max() > 1e-4  # the honest clients did move
    assert folded.attacked == (0, 3)


def test_label_flipping_reaches_the_worker_as_a_poisoned_fit():
    digits = lambda: meshkit.plugins.create("task", "digits")  # noqa: E731
    ctx = ctx_for(plan("label-flip", [0]), task=digits)
    state = ctx.task.init_state(0)
    folded = fold_round(ctx, fits(2), state=state)
    sent = [request for _, request in ctx.pool.log if request.get("op") == "fit"]
    assert {r["shard"]: r.get("poison") for r in sent} == {
        0: {"name": "label-flip", "options": {}}, 1: None}
    honest = fold_round(ctx_for(task=digits), fits(2), state=state)
    assert not np.allclose(folded.result["output.w"], honest.result["output.w"])
    assert folded.attacked == (0,)


def test_a_node_attack_is_declared_in_the_reply_and_recorded():
    trainers = {1: Trainer(synthetic()), 2: Trainer(synthetic())}
    trainers[2].attack = meshkit.plugins.create("attack", "scale", {"factor": 3.0})
    trainers[2].attack_name = "scale"
    ctx = ctx_for(trainers=trainers)
    folded = fold_round(ctx, fits(4), state=ctx.task.init_state(0))
    by_two = tuple(sorted(k for k, r in folded.served.items() if r == 2))
    assert by_two and folded.attacked == by_two
    assert all(folded.replies[k]["attacked"] == "scale" for k in by_two)


def test_the_metrics_line_lists_the_attacked_clients():
    from meshkit.train import RoundReport
    line = RoundReport(1, 1, "federated", answered=(1,), attacked=(2, 5)).to_json()
    assert json.loads(json.dumps(line))["attacked"] == [2, 5]


@pytest.mark.parametrize("table,message", [
    ({"name": "scale"}, "give exactly one"),
    ({"name": "scale", "clients": [1], "fraction": 0.2}, "give exactly one"),
    ({"name": "scale", "clients": []}, "non-empty list of client ids"),
    ({"name": "scale", "fraction": 1.5}, "expected a number in \\(0, 1\\]"),
    ({"clients": [0]}, "\\[attack\\] name: expected an attack name"),
])
def test_a_bad_attack_table_is_a_config_error_naming_the_key(table, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"attack": table}, path="job.toml")


def test_an_attack_option_is_checked_against_the_attacks_options_class(tmp_path):
    from meshkit.train._coordinator.plan import resolve
    config = parse_config({"run": {"out": str(tmp_path / "out")},
                           "attack": {"name": "scale", "fraction": 0.5, "factr": 2}},
                          path="job.toml")
    with pytest.raises(ConfigError, match="job.toml: \\[attack\\].*factr"):
        resolve(config)


def test_data_parallel_has_no_clients_to_attack(tmp_path):
    from meshkit.train._coordinator.plan import resolve
    from meshkit.train import build_components
    config = parse_config({"run": {"out": str(tmp_path / "out")},
                           "strategy": {"name": "data-parallel"},
                           "aggregator": {"name": "allreduce"},
                           "attack": {"name": "scale", "clients": [0]}}, path="job.toml")
    with pytest.raises(ConfigError, match="has no clients to make Byzantine"):
        build_components(resolve(config))


def test_the_attack_is_part_of_the_runs_identity(tmp_path):
    """--resume refuses a checkpoint made under another [attack] (or none)."""
    from meshkit.train._coordinator.plan import resolve
    from meshkit.train._coordinator.resume import identity
    base = {"run": {"out": str(tmp_path / "out")}}
    attacked = resolve(parse_config({**base, "attack": {"name": "alie", "fraction": 0.2}},
                                    path="job.toml"))
    honest = resolve(parse_config(base, path="job.toml"))
    assert identity(attacked)["attack"] == "alie" and identity(honest)["attack"] is None
