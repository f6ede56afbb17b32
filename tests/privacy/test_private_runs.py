"""Private runs end to end: real workers, ε in every row, a budget that stops the run cleanly,
a bit-exact resume, clipping on the clients, a host relay, and the refusals that keep the
guarantee."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import meshkit
from meshkit.checkpoint import load_checkpoint
from meshkit.config import parse_config
from meshkit.train._coordinator.plan import resolve
from meshkit.testing.support import assert_states_identical
from meshkit.train import build_components, read_metrics

from tests.support.cli import run_cli


def table(out: Path, *, rounds: int = 4, privacy: dict[str, Any] | None = None,
          **strategy: Any) -> dict[str, Any]:
    return {"run": {"out": str(out), "seed": 5},
            "mesh": {"workers": 2, "timeout": 20.0},
            "strategy": {"rounds": rounds, "clients": 40, "fraction": 0.25,
                         "sampling": "poisson", **strategy},
            "privacy": {"name": "dp-fixed", "clip_norm": 1.0, "noise_multiplier": 1.0,
                        "noise": "seeded", **(privacy or {})}}


def _plan(config: dict[str, Any]) -> dict[str, Any]:
    return build_components(resolve(parse_config(config)))


@pytest.mark.slow
def test_a_budget_stops_the_run_before_it_is_exceeded_and_a_resume_is_bit_exact(
        tmp_path, monkeypatch):
    # q = 0.25, z = 1: epsilon after 1, 2, 3, 4 rounds
    eps = _plan(table(tmp_path / "p", rounds=4))["privacy"].epsilon_after
    steps = [eps(0.25, t) for t in (1, 2, 3, 4)]
    budget = (steps[1] + steps[2]) / 2  # room for two rounds, not three
    clients_clip = {"clip": "client"}
    stopped = meshkit.run(table(tmp_path / "a", privacy={**clients_clip,
                                                          "target_epsilon": budget}))
    assert stopped.ok and stopped.rounds_completed == 2
    assert "round 3 would take epsilon to" in stopped.stopped
    rows = read_metrics(tmp_path / "a")
    assert [r["round"] for r in rows] == [1, 2]
    assert [r["epsilon"] for r in rows] == pytest.approx(steps[:2], rel=1e-9)
    assert all(r["epsilon"] <= budget for r in rows)
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["epsilon"] == pytest.approx(steps[1]) and summary["stopped"]
    assert load_checkpoint(tmp_path / "a").round == 2  # the checkpoint is intact
    # a larger budget continues from the checkpoint ...
    larger = {**clients_clip, "target_epsilon": steps[3] + 1}
    resumed = meshkit.run(table(tmp_path / "a", privacy=larger), resume=True)
    assert resumed.ok and resumed.rounds_completed == 4 and not resumed.stopped
    # ... to the very bits of a run never stopped, and that one went through a
    # host relay: the relay forwards each clipped update (no fold, no noise of
    # its own) and the noise is added once, on the coordinator
    sent, behind = _watch_relays(monkeypatch)
    whole_config = table(tmp_path / "b", privacy=larger)
    whole_config["mesh"]["relays"] = 1
    whole = meshkit.run(whole_config)
    assert behind and all(behind) and "fold" not in sent
    assert_states_identical(resumed.state, whole.state, what="resumed vs uninterrupted")
    assert ([r["epsilon"] for r in read_metrics(tmp_path / "a")]
            == [r["epsilon"] for r in read_metrics(tmp_path / "b")])
    assert (load_checkpoint(tmp_path / "a").privacy_state
            == load_checkpoint(tmp_path / "b").privacy_state)


def _watch_relays(monkeypatch) -> tuple[list[str], list[bool]]:
    """Record the ops sent to relays, and per round whether every worker was behind one."""
    from meshkit.train import GroupPool
    from meshkit.train._rounds import engine as _engine
    from meshkit.train._rounds import relayed as _host_relay

    sent: list[str] = []
    behind: list[bool] = []
    send, plan = GroupPool.send_relay, _engine.relay_plan_applies

    def recording(self, name, request, timeout):
        sent.append(request["op"])
        return send(self, name, request, timeout)

    def seen(ctx, fold, weight, keys):
        behind.append(_host_relay.relay_groups(ctx) is not None)
        return plan(ctx, fold, weight, keys)

    monkeypatch.setattr(GroupPool, "send_relay", recording)
    monkeypatch.setattr(_engine, "relay_plan_applies", seen)
    return sent, behind


@pytest.mark.slow
def test_a_cli_run_with_adaptive_clipping(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(f"""
[run]
task = "digits"
seed = 1
out = "{tmp_path / 'out'}"

[mesh]
workers = 2

[strategy]
rounds = 3
clients = 30
fraction = 0.3
sampling = "poisson"

[privacy]
name = "dp-adaptive"
initial_clip_norm = 5.0
noise_multiplier = 0.5
count_noise_multiplier = 2.0
accountant = "rdp"
noise = "seeded"
""")
    result = run_cli("run", str(config), timeout=120)
    assert result.returncode == 0, result.stderr
    assert "epsilon" in result.stdout  # the progress line
    rows = read_metrics(tmp_path / "out")
    assert len(rows) == 3
    epsilons = [r["epsilon"] for r in rows]
    assert epsilons == sorted(epsilons) and epsilons[0] > 0
    clips = [r["clip_norm"] for r in rows]
    assert clips[0] == 5.0 and clips[1] != clips[0]  # S follows the update norms
    assert all(np.isfinite(r["accuracy"]) for r in rows)


def test_check_prints_the_epsilon_the_run_will_reach(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(f"""
[run]
out = "{tmp_path / 'out'}"
[mesh]
workers = 2
[strategy]
rounds = 200
clients = 100
fraction = 0.05
sampling = "poisson"
[privacy]
name = "dp-fixed"
noise_multiplier = 1.0
target_epsilon = 3.0
""")
    result = run_cli("check", str(config))
    assert result.returncode == 0, result.stderr
    # dp-accounting's PLD: 4.77 for q = 0.05, z = 1, 200 rounds, delta = 1e-5
    assert re.search(r"privacy: epsilon 4\.7[67]\d* at delta 1e-05 after 200 round", result.stdout)
    assert "target_epsilon 3 stops the run after round" in result.stdout


@pytest.mark.parametrize("change, message", [
    ({"aggregator": {"name": "median"}},
     r"\[aggregator\] name = 'median'.*lacks the trait AggregatorTraits.linear.*fedavg"),
    ({"aggregator": {"name": "norm-bound", "max_norm": 1.0}},
     r"\[aggregator\] name = 'norm-bound'.*lacks the trait AggregatorTraits.linear.*"
     r"clip_norm already bounds each update"),
    ({"strategy": {"sampling": "fixed", "fraction": 0.5}}, "a fixed-size cohort is not Poisson"),
    ({"strategy": {"evaluate": "clients"}}, "published in metrics.jsonl with no noise"),
    ({"strategy": {"name": "local"}}, "only a strategy that plays private rounds"),
])
def test_combinations_that_break_the_guarantee_are_refused(tmp_path, change, message):
    config = table(tmp_path / "out")
    for key, values in change.items():
        config.setdefault(key, {}).update(values)
    if config["strategy"].get("name") == "local":
        config["strategy"] = {"name": "local"}
    with pytest.raises(meshkit.RefusedError, match=message):
        _plan(config)


def test_every_client_every_round_is_accounted_without_amplification(tmp_path):
    config = table(tmp_path / "out", rounds=10, sampling="fixed", fraction=1.0)
    plan = _plan(config)["privacy_plan"]
    assert plan["q"] == 1.0 and plan["expected_cohort"] == 40


def test_a_privacy_table_needs_a_name_and_valid_keys(tmp_path):
    config = table(tmp_path / "out")
    config["privacy"].pop("name")
    with pytest.raises(meshkit.ConfigError, match=r"\[privacy\] name"):
        parse_config(config)
    config = table(tmp_path / "out", privacy={"clip": "server"})
    with pytest.raises(meshkit.ConfigError, match=r"\[privacy\] clip: .*clip must be one of"):
        resolve(parse_config(config))



def test_the_shipped_private_example_checks_and_stays_within_its_budget():
    from meshkit.config import load_config

    example = Path(__file__).resolve().parents[2] / "examples" / "federated-private.toml"
    plan = build_components(resolve(load_config(example)))["privacy_plan"]
    assert plan["q"] == 0.05 and plan["expected_cohort"] == 50
    assert plan["epsilon"] <= plan["target_epsilon"]


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["coordinator", "client"])
def test_a_private_run_on_worker_processes_folds_per_worker_to_the_per_client_bits(
        tmp_path, monkeypatch, placement):
    # Real worker processes: each folds its clients' clipped updates and sends one partial
    # a round; the model, epsilon and adaptive S are those of the per-client round.
    from meshkit.train._rounds import engine as _engine

    def config(name: str) -> dict[str, Any]:
        out = table(tmp_path / name, rounds=3)
        out["privacy"] = {"name": "dp-adaptive", "clip": placement, "initial_clip_norm": 1.0,
                          "noise_multiplier": 0.8, "count_noise_multiplier": 2.0,
                          "noise": "seeded"}
        return out

    paths: list[str] = []
    path = _engine.round_path
    monkeypatch.setattr(_engine, "round_path",
                        lambda call: paths.append(path(call).name) or path(call))
    batched = meshkit.run(config("batched"))
    assert batched.ok and paths == ["batched"] * 3
    paths.clear()
    monkeypatch.setattr(_engine, "batch_applies", lambda *a, **k: False)
    flat = meshkit.run(config("flat"))
    assert flat.ok and paths == ["flat"] * 3
    assert_states_identical(batched.state, flat.state, what="folded per worker vs per client")
    rows = {name: read_metrics(tmp_path / name) for name in ("batched", "flat")}
    for key in ("epsilon", "clip_norm", "cohort", "clients"):
        assert [r[key] for r in rows["batched"]] == [r[key] for r in rows["flat"]], key
    assert len({r["clip_norm"] for r in rows["batched"]}) == 3  # S moved on the counted bits
    # one partial per worker, not one model per client: fewer bytes up
    for folded, per_client in zip(rows["batched"], rows["flat"]):
        assert folded["bytes_up"] < per_client["bytes_up"]
