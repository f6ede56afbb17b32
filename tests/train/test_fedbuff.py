"""``fedbuff``'s rules, driven in-process through LocalPool (the real-process runs are in
test_fedbuff_run.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import meshkit
import meshkit.plugins
from meshkit.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from meshkit.config import parse_config
from meshkit.train._coordinator.plan import resolve
from meshkit.simulation import Speeds
from meshkit.task import FitResult
from meshkit.train import AttackPlan, LocalPool, StrategyContext, build_components
from meshkit_strategies.fedbuff import staleness_weight
from meshkit_tasks.digits import DigitsTask
from meshkit_tasks.options import DigitsOptions


class AddOne:
    """A model of one number; every fit adds 1 to the version it was sent (Δ = −1)."""

    def init_state(self, seed: int) -> dict:
        return {"m": np.zeros(1)}

    def train_data(self):
        return np.zeros((8, 1)), np.zeros(8)

    def fit(self, state, x, y, *, seed):
        return FitResult({"m": np.asarray(state["m"]) + 1.0}, len(x), {"train_loss": 0.5})

    def evaluate(self, state):
        return {"m": float(np.asarray(state["m"])[0])}


class ShardMean(AddOne):
    """The fit's model is the mean of its shard's rows (a fedavg round is their mean)."""

    def train_data(self):
        return np.arange(8, dtype=np.float64).reshape(8, 1), np.zeros(8)

    def fit(self, state, x, y, *, seed):
        return FitResult({"m": np.array([x.mean()])}, len(x), {})


def make_ctx(task, ranks=(1, 2), *, aggregator="fedavg", speeds=None, order=None, fail=None,
             aggregator_options=None, **kw) -> StrategyContext:
    pool = LocalPool.of(lambda: task, ranks, order=order, fail=fail)
    return StrategyContext(task=task, aggregator=meshkit.plugins.create("aggregator",
                                                                        aggregator,
                                                                        aggregator_options),
                           pool=pool, workers=list(ranks), rng=np.random.default_rng(0),
                           outer=meshkit.plugins.create("outer_optimizer", "average"),
                           speeds=speeds, **kw)


def fedbuff(**options):
    return meshkit.plugins.create("strategy", "fedbuff", options)


def reports_of(ctx):
    rows = []
    ctx.on_round = lambda report, state: rows.append(report)
    return rows


# -- the staleness rules ---------------------------------------------------------


@pytest.mark.parametrize("rule, a, b, tau, expected", [
    ("sqrt", None, None, 0, 1.0),
    ("sqrt", None, None, 3, 0.5),                      # 1/sqrt(4)
    ("sqrt", None, None, 8, 1 / 3),                    # 1/sqrt(9)
    ("poly", None, None, 3, 0.5),                      # (1+3)^-0.5, a = 0.5
    ("poly", 2.0, None, 4, 1 / 25),                    # (1+4)^-2
    ("poly", 1.0, None, 0, 1.0),
    ("hinge", None, None, 4, 1.0),                     # tau <= b = 4
    ("hinge", None, None, 5, 1 / 11),                  # 1/(10*(5-4)+1)
    ("hinge", 2.0, 1.0, 3, 0.2),                       # 1/(2*(3-1)+1)
    ("hinge", 2.0, 1.0, 1, 1.0),
    ("constant", None, None, 0, 1.0),
    ("constant", None, None, 50, 1.0),
])
def test_each_staleness_rule_gives_its_hand_computed_weight(rule, a, b, tau, expected):
    assert staleness_weight(rule, tau, a, b) == pytest.approx(expected, rel=1e-15)


# -- the buffer and the step -------------------------------------------------------


def test_a_buffer_of_every_client_at_staleness_zero_is_a_fedavg_round():
    task = ShardMean()
    ctx = make_ctx(task)
    # 3 clients of 8 rows: blocks [0..2], [3..5], [6..7], means 1, 4, 6.5, weights 3, 3, 2.
    result = fedbuff(rounds=1, clients=3, buffer_size=3, concurrency=3).run(ctx)
    assert float(result.state["m"][0]) == pytest.approx((3 * 1 + 3 * 4 + 2 * 6.5) / 8)


def test_the_virtual_clock_folds_by_simulated_finish_and_weights_by_staleness(tmp_path):
    # Client 0 takes 1 simulated second, client 1 three: client 0 serves steps 1 and 2
    # (fresh), then client 1's update from version 0 arrives 2 steps stale at t = 3,
    # ahead of client 0's third fit (same finish, dispatched later).
    speeds = Speeds(table={0: 1.0, 1: 3.0}, source="test")
    ctx = make_ctx(AddOne(), speeds=speeds)
    rows = reports_of(ctx)
    result = fedbuff(rounds=4, clients=2, buffer_size=1, concurrency=2).run(ctx)
    assert [r.simulated_time for r in rows] == [1.0, 2.0, 3.0, 3.0]
    assert [r.clients for r in rows] == [(0,), (0,), (1,), (0,)]
    assert [dict(r.staleness) for r in rows] == [{0: 1}, {0: 1}, {2: 1}, {1: 1}]
    assert rows[2].client_weights == {1: pytest.approx(1 / math.sqrt(3))}
    # Each update adds s(τ): 1 + 1 + 1/sqrt(3) + 1/sqrt(2).
    assert float(result.state["m"][0]) == pytest.approx(2 + 1 / math.sqrt(3)
                                                        + 1 / math.sqrt(2))
    line = rows[2].to_json()
    assert line["staleness"] == {"2": 1} and line["simulated_time"] == 3.0
    assert line["client_staleness"] == {"1": 2}


def test_an_update_staler_than_max_staleness_is_dropped_and_recorded():
    speeds = Speeds(table={0: 1.0, 1: 3.0}, source="test")
    ctx = make_ctx(AddOne(), speeds=speeds)
    rows = reports_of(ctx)
    result = fedbuff(rounds=3, clients=2, buffer_size=1, concurrency=2,
                     max_staleness=1).run(ctx)
    assert "stale: τ = 2 > max_staleness = 1" in rows[2].not_served[1]
    assert all(1 not in r.clients for r in rows)
    assert float(result.state["m"][0]) == pytest.approx(3.0)  # three fresh updates of 1


def test_k_updates_make_one_step_with_the_mean_of_their_staleness_weighted_updates():
    # allreduce: every update counts 1, so the step is x - (1/K) sum s(τ_i) Δ_i (the paper's).
    speeds = Speeds(table={0: 1.0, 1: 1.5, 2: 2.0}, source="test")
    ctx = make_ctx(AddOne(), aggregator="allreduce", speeds=speeds)
    rows = reports_of(ctx)
    result = fedbuff(rounds=2, clients=3, buffer_size=2, concurrency=3,
                     staleness="constant").run(ctx)
    assert [sorted(r.clients) for r in rows] == [[0, 1], [0, 2]]
    assert float(result.state["m"][0]) == pytest.approx(2.0)
    assert rows[1].client_weights == {0: 0.5, 2: 0.5}


# -- determinism, resume ------------------------------------------------------------


def digits_run(order_seed, rounds=4, speeds=None, **kw):
    task = DigitsTask(DigitsOptions(hidden=8))
    speeds = speeds or Speeds(seed=3, sigma=1.0)
    ctx = make_ctx(task, ranks=(1, 2, 3), speeds=speeds, seed=3,
                   order=np.random.default_rng(order_seed), **kw)
    rows = reports_of(ctx)
    strategy = fedbuff(rounds=rounds, clients=12, buffer_size=3, concurrency=5)
    saved = []
    inner = ctx.on_round

    def keep(report, state):
        inner(report, state)
        saved.append((report.round, dict(state), ctx.strategy_state()))
    ctx.on_round = keep
    return strategy.run(ctx), rows, saved


def test_the_virtual_clock_replays_bit_for_bit_whatever_order_workers_answer_in():
    a, rows_a, _ = digits_run(order_seed=1)
    b, rows_b, _ = digits_run(order_seed=2)
    for key in a.state:
        assert np.array_equal(a.state[key], b.state[key]), key
    assert [r.clients for r in rows_a] == [r.clients for r in rows_b]
    assert [r.simulated_time for r in rows_a] == [r.simulated_time for r in rows_b]
    assert [r.served for r in rows_a] != [] and any(
        sum(r.staleness.values()) and max(r.staleness) > 0 for r in rows_a)


def test_a_resumed_run_continues_exactly_from_its_checkpoints_versions_in_flight(tmp_path):
    whole, rows, saved = digits_run(order_seed=1, rounds=5)
    step, state, extra = saved[1]  # after step 2, fits in flight from versions 1 and 2
    assert extra["flights"] and extra["models"]
    # Through a real checkpoint file, as --resume reads it.
    save_checkpoint(tmp_path, Checkpoint(round=step, state=state, strategy_state=extra))
    ckpt = load_checkpoint(tmp_path)
    resumed, rows_after, _ = digits_run(order_seed=9, rounds=5,
                                        start_round=ckpt.round, global_state=ckpt.state,
                                        saved=ckpt.strategy_state)
    for key in whole.state:
        assert np.array_equal(whole.state[key], resumed.state[key]), key
    assert [r.clients for r in rows_after] == [r.clients for r in rows[2:]]


# -- real time ------------------------------------------------------------------------


def test_on_real_time_a_dead_worker_lowers_the_concurrency_and_the_run_goes_on():
    sent = []

    def fail(rank, request):
        sent.append(rank)
        return "killed" if rank == 2 and sent.count(2) >= 2 else None

    ctx = make_ctx(AddOne(), ranks=(1, 2), fail=fail)
    rows = reports_of(ctx)
    fedbuff(rounds=4, clients=4, buffer_size=1, concurrency=2).run(ctx)
    assert len(rows) == 4 and ctx.dead == {2: "killed"}
    lost = [why for r in rows for why in r.not_served.values()]
    assert any("lost: rank 2" in why for why in lost)
    assert {r.answered for r in rows[-2:]} == {(1,)}
    assert all(r.simulated_time is None for r in rows)


def test_on_real_time_a_worker_taken_in_between_steps_trains_from_the_next_step_on():
    from meshkit.train import Trainer

    task = AddOne()
    ctx = make_ctx(task, ranks=(1,))
    rows = reports_of(ctx)
    calls = []

    def admit():
        calls.append(1)
        if len(calls) != 3:
            return ()
        ctx.pool.trainers[2] = Trainer(task)  # a node joining before step 3
        ctx.workers.append(2)
        return (2,)
    ctx.admit = admit
    fedbuff(rounds=5, clients=4, buffer_size=1, concurrency=2).run(ctx)
    assert rows[2].joined == (2,)
    assert {rank for r in rows[:2] for rank in r.served.values()} == {1}
    assert 2 in {rank for r in rows[2:] for rank in r.served.values()}


# -- refusals ------------------------------------------------------------------------


def check_config(tmp_path, strategy="", extra=""):
    text = {"run": {"task": "digits", "out": str(tmp_path / "out")},
            "mesh": {"workers": 2},
            "strategy": {"name": "fedbuff", "clients": 8, "buffer_size": 2,
                         "concurrency": 2, **(strategy or {})}}
    text.update(extra or {})
    return build_components(resolve(parse_config(text, path="run.toml")))


@pytest.mark.parametrize("extra, words", [
    ({"attack": {"name": "alie", "clients": [0]}},
     ["[attack] name = 'alie'", '"fedbuff"', "omniscient", "federated"]),
    ({"privacy": {"name": "dp-fixed", "clip_norm": 1.0, "noise_multiplier": 1.0}},
     ["[privacy]", "'fedbuff'", "StrategyTraits.private", "amplification cannot be claimed",
      "no accountant for the buffered mechanism", "federated"]),
    ({"secure_aggregation": {"name": "secagg+"}},
     ["[secure_aggregation]", "'fedbuff'", "StrategyTraits.secure",
      "trusted execution enclave"]),
    ({"partitioner": {"name": "local"}}, ['name = "local"', "fedbuff"]),
    ({"strategy": {"name": "fedbuff", "clients": 8, "buffer_size": 2, "concurrency": 2,
                   "time_budget": 1.0}, "simulation": {}},
     ["[strategy] time_budget = 1 with [simulation]", "replay"]),
])
def test_what_fedbuff_cannot_compose_with_is_refused_naming_both_keys(tmp_path, extra, words):
    with pytest.raises(meshkit.RefusedError) as info:
        check_config(tmp_path, extra=extra)
    for word in words:
        assert word in str(info.value)


def test_evaluate_on_clients_is_refused_with_fedbuff(tmp_path):
    with pytest.raises(meshkit.RefusedError, match="evaluate = 'clients'"):
        check_config(tmp_path, strategy={"evaluate": "clients"})


@pytest.mark.parametrize("strategy, words", [
    ({"staleness_a": 2.0}, "staleness_a = 2: only the \"poly\" and \"hinge\""),
    ({"staleness": "poly", "staleness_b": 1.0}, "staleness_b = 1: only the \"hinge\""),
    ({"buffer_size": 9}, "buffer_size = 9, but there are only 8 clients"),
    ({"concurrency": 9}, "concurrency = 9, but there are only 8 clients"),
])
def test_fedbuff_options_that_would_do_nothing_or_cannot_work_are_config_errors(
        tmp_path, strategy, words):
    with pytest.raises(meshkit.ConfigError) as info:
        check_config(tmp_path, strategy=strategy)
    assert "run.toml" in str(info.value) and words in str(info.value)


def test_a_simulation_table_with_a_strategy_that_ignores_the_clock_is_refused(tmp_path):
    text = {"run": {"out": str(tmp_path / "out")}, "strategy": {"name": "federated"},
            "simulation": {"sigma": 0.5}}
    with pytest.raises(meshkit.ConfigError, match=r"\[simulation\]: strategy 'federated'"):
        build_components(resolve(parse_config(text, path="run.toml")))


# -- robust rules fold each buffer -----------------------------------------------------


def attacked_digits_run(aggregator, attackers=(), rounds=12, **options):
    """fedbuff on digits, on the virtual clock; ``attackers`` flip their updates (×4)."""
    task = DigitsTask(DigitsOptions(hidden=16))
    attack = AttackPlan(name="sign-flip", options={"factor": 4.0},
                        attack=meshkit.plugins.create("attack", "sign-flip", {"factor": 4.0}),
                        clients=tuple(attackers), seed=3) if attackers else None
    ctx = make_ctx(task, ranks=(1, 2), aggregator=aggregator, speeds=Speeds(seed=3, sigma=1.0),
                   seed=3, attack=attack, aggregator_options=options or None)
    rows = reports_of(ctx)
    strategy = fedbuff(rounds=rounds, clients=20, buffer_size=10, concurrency=12)
    return strategy.run(ctx), rows


def test_multi_krum_folds_each_buffer_and_holds_accuracy_under_a_sign_flip_attack():
    attackers = (0, 1, 2, 3)  # 4 of 20 clients: about 2 in a buffer of 10, f = 3
    clean, _ = attacked_digits_run("multi-krum", f=3)
    defended, rows = attacked_digits_run("multi-krum", attackers, f=3)
    undefended, _ = attacked_digits_run("fedavg", attackers)
    assert any(r.attacked for r in rows), "the attackers' updates reached the buffers"
    assert all(set(r.attacked) <= set(attackers) for r in rows)
    assert all(r.simulated_time is not None for r in rows)
    accuracy = {name: result.metrics["accuracy"]
                for name, result in (("clean", clean), ("defended", defended),
                                     ("undefended", undefended))}
    assert accuracy["defended"] >= accuracy["clean"] - 0.03, accuracy
    # The attack is strong enough to matter: the plain mean is broken by it.
    assert accuracy["undefended"] < accuracy["clean"] - 0.10, accuracy


def test_a_rule_that_is_not_linear_combines_the_buffers_updates_against_the_current_model():
    # Median of three fresh updates of one number: each client's fit is its shard's mean.
    task = ShardMean()
    ctx = make_ctx(task, aggregator="median")
    rows = reports_of(ctx)
    result = fedbuff(rounds=1, clients=3, buffer_size=3, concurrency=3).run(ctx)
    # Shards rows [0, 1], [2, 3], [4..7]: fits 0.5, 2.5, 5.5, every τ = 0. The median
    # moves the model to 2.5 (the examples-weighted mean would be 3.5).
    assert rows[0].client_examples == {0: 2, 1: 2, 2: 4}
    assert dict(rows[0].staleness) == {0: 3}
    assert float(result.state["m"][0]) == 2.5


def test_a_bfloat16_parameter_takes_the_buffers_mean_not_the_last_update():
    # np.floating does not know bfloat16: its arrays were kept as the last update's value.
    from meshkit.state import BFLOAT16
    from meshkit_strategies.fedbuff import Buffer

    start = {"h": np.zeros(3, BFLOAT16), "steps": np.array(4, np.int64)}
    buffer = Buffer()
    for client, value in enumerate((1.0, 3.0)):
        fitted = {"h": np.full(3, value, BFLOAT16), "steps": np.array(5, np.int64)}
        buffer.add(start, fitted, client=client, rank=1, tau=0, mass=1.0, scale=1.0,
                   examples=10, loss=None)
    out = buffer.consensus(start)
    assert out["h"].dtype == BFLOAT16
    np.testing.assert_array_equal(out["h"].astype(np.float32), np.full(3, 2.0, np.float32))
    assert out["steps"] == 5
