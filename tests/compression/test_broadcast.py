"""``[compression] broadcast = true``: the model goes down as a compressed delta against the
model each worker holds (meshkit.train._broadcast).

* the coordinator and every worker hold the same bits after each round (the worker checks
  the digest of what it decoded), and the quantisation error does not drift: the model
  the workers hold stays within one quantisation step of the global model;
* a worker that does not hold the delta's base (a restarted process, a set_state in
  between) changes nothing, answers ``stale``, and is sent the whole model in that round;
* the bytes the transport sent down drop against the uncompressed run's, and digits'
  accuracy stays within a point (slow: real processes);
* what cannot broadcast is refused, naming the trait.
"""

from __future__ import annotations

import signal

import numpy as np
import pytest
from click.testing import CliRunner

import meshkit
from meshkit.checkpoint import load_checkpoint
from meshkit.cli import main
from meshkit.compression import CompressionPlan
from meshkit.config import load_config
from meshkit.errors import ConfigError
from meshkit.train import (
    Broadcast,
    LocalPool,
    StrategyContext,
    Trainer,
    read_metrics,
    state_digest,
)
from meshkit.train._broadcast import apply_delta, encode_delta
from tests.support.cli import run_cli
from tests.support.configs import KILLER, write_config

#: A config's [compression] table with the broadcast on.
BROADCAST = '\n[compression]\nname = "quantize"\nbroadcast = true\n'


def _plan(name: str = "quantize", **options) -> CompressionPlan:
    return CompressionPlan(name, options, meshkit.plugins.create("compression", name, options),
                           broadcast=True)


def _digits():
    return meshkit.plugins.create("task", "digits", {})


def _walk(state, rng, scale=0.05):
    """The next round's global model: every float array moved a little."""
    return {k: (v + rng.standard_normal(v.shape) * scale).astype(v.dtype)
            if isinstance(v, np.ndarray) and v.dtype.kind == "f" else v
            for k, v in state.items()}


def _same_bits(a, b):
    assert sorted(a) == sorted(b)
    for key in a:
        assert np.asarray(a[key]).tobytes() == np.asarray(b[key]).tobytes(), key


@pytest.mark.parametrize("options", [{"bits": 8}, {"bits": 2, "rotate": True}])
def test_worker_and_coordinator_hold_the_same_bits_round_after_round(options):
    rng = np.random.default_rng(3)
    task = _digits()
    broadcast = Broadcast(_plan(**options), seed=11)
    worker = Trainer(task)
    state = task.init_state(0)
    kinds = []
    for rnd in range(1, 7):
        model = broadcast.prepare(state, rnd)
        request = broadcast.set_state(1)
        kinds.append("delta" if "base" in request else "whole")
        reply = worker.handle({**request, "seq": rnd})
        assert reply == {"seq": rnd}, reply
        assert worker.state is not None
        _same_bits(worker.state, model)
        assert worker.digest == state_digest(model) == broadcast.digest
        state = _walk(state, rng)
    assert kinds == ["whole"] + ["delta"] * 5
    assert broadcast.sent == {"whole": 1, "delta": 5}


def test_the_quantisation_error_does_not_drift():
    # Each round's delta is the global model minus the model the workers hold, so what
    # one round's quantisation left out is sent the next: the gap stays within one
    # quantisation step (range / 255 of the delta's chunk), round after round.
    rng = np.random.default_rng(5)
    plan = _plan(bits=8)
    broadcast = Broadcast(plan, seed=1)
    state = _digits().init_state(0)
    broadcast.prepare(state, 1)
    gaps = []
    for rnd in range(2, 42):
        state = _walk(state, rng, scale=0.01)
        model = broadcast.prepare(state, rnd)
        assert broadcast.delta is not None
        for key, value in state.items():
            if not isinstance(value, np.ndarray):
                continue
            step = float(np.max(broadcast.delta[f"{key}\x1fstep"]))
            gap = float(np.max(np.abs(value.astype(np.float64) - model[key])))
            assert gap <= step * (1 + 1e-6) + 1e-12, (rnd, key, gap, step)
            gaps.append(gap)
    # A drifting model's gap would grow like sqrt(rounds); this one's does not.
    assert max(gaps[-20:]) <= 2 * max(gaps[:20])


def test_a_worker_without_the_base_answers_stale_and_changes_nothing():
    task = _digits()
    broadcast = Broadcast(_plan(bits=8), seed=2)
    worker = Trainer(task)
    state = task.init_state(0)
    broadcast.prepare(state, 1)
    worker.handle({**broadcast.set_state(1), "seq": 1})
    # Another set_state in between (an evaluation's, a skipped round's): no digest now.
    other = _walk(state, np.random.default_rng(0))
    worker.handle({"op": "set_state", "seq": 2, "state": other})
    assert worker.digest is None
    broadcast.prepare(_walk(state, np.random.default_rng(1)), 2)
    delta = broadcast.set_state(1)
    assert "base" in delta
    reply = worker.handle({**delta, "seq": 3})
    assert "holds no broadcast model" in reply["stale"]
    _same_bits(worker.state, other)  # nothing changed
    # The coordinator is told, and the next request is the whole model.
    broadcast.stale(1)
    whole = broadcast.set_state(1)
    assert "base" not in whole and whole["digest"] == broadcast.digest
    assert worker.handle({**whole, "seq": 4}) == {"seq": 4}
    _same_bits(worker.state, broadcast.model)


def test_a_delta_for_another_base_or_decoding_to_another_digest_is_never_applied():
    task = _digits()
    broadcast = Broadcast(_plan(bits=8), seed=2)
    worker = Trainer(task)
    state = task.init_state(0)
    broadcast.prepare(state, 1)
    worker.handle({**broadcast.set_state(1), "seq": 1})
    held = dict(worker.state)
    broadcast.prepare(_walk(state, np.random.default_rng(1)), 2)
    delta = broadcast.set_state(1)
    wrong_base = worker.handle({**delta, "base": "0" * 64, "seq": 2})
    assert "not the delta's base" in wrong_base["stale"]
    wrong_digest = worker.handle({**delta, "digest": "f" * 64, "seq": 3})
    assert "decoded to model" in wrong_digest["stale"]
    _same_bits(worker.state, held)
    assert worker.digest == broadcast.base  # it still holds the base: the real delta applies
    assert worker.handle({**delta, "seq": 4}) == {"seq": 4}
    _same_bits(worker.state, broadcast.model)


def test_a_delta_is_the_same_bits_decoded_anywhere_and_raw_keys_travel_whole():
    rng = np.random.default_rng(0)
    compressor = meshkit.plugins.create("compression", "top-k", {"fraction": 0.1})
    base = {"w": rng.standard_normal(50).astype(np.float32), "n": np.arange(3),
            "bn.mean": np.zeros(4, np.float32), "meta": {"v": 1}}
    target = {**_walk(base, rng), "n": np.arange(3) + 1, "meta": {"v": 2}}
    payload = encode_delta(compressor, base, target, seed=4, raw=["bn.mean"])
    assert sorted(payload) == ["bn.mean", "meta", "n", "w\x1findex", "w\x1fvalue"]
    assert payload["w\x1findex"].size == 5  # 10 % of 50, no residual
    one = apply_delta(compressor, base, payload, raw=["bn.mean"])
    two = apply_delta(compressor, {k: np.copy(v) if isinstance(v, np.ndarray) else v
                                   for k, v in base.items()}, payload, raw=["bn.mean"])
    _same_bits(one, two)
    assert one["bn.mean"].tobytes() == target["bn.mean"].tobytes()
    assert one["meta"] == {"v": 2} and list(one["n"]) == [1, 2, 3]


def _ctx(task, plan, ranks=(1, 2), fail=None):
    return StrategyContext(task=task, aggregator=meshkit.plugins.create("aggregator", "fedavg"),
                           pool=LocalPool.of(lambda: task, ranks, fail=fail),
                           workers=list(ranks), rng=np.random.default_rng(0),
                           outer=meshkit.plugins.create("outer_optimizer", "average"),
                           compression=plan, seed=7)


def _set_states(pool):
    return [(rank, request) for rank, request in pool.log if request["op"] == "set_state"]


def test_a_federated_run_sends_deltas_and_every_worker_ends_on_the_coordinators_bits():
    task = _digits()
    ctx = _ctx(task, _plan(bits=8))
    federated = meshkit.plugins.create("strategy", "federated", {"rounds": 4, "clients": 4})
    federated.run(ctx)
    sent = _set_states(ctx.pool)
    assert len(sent) == 8  # one a worker a round: nobody was stale
    assert ["base" in r for _, r in sent] == [False] * 2 + [True] * 6
    last = {rank: r["digest"] for rank, r in sent}
    for rank, trainer in ctx.pool.trainers.items():
        assert trainer.digest == last[rank] == state_digest(trainer.state)


def test_a_worker_that_lost_its_model_mid_run_is_sent_the_whole_model_in_that_round():
    task = _digits()
    seen = []

    def restart(rank, request):
        # Rank 2 comes back as a fresh process before round 3's set_state reaches it.
        if rank == 2 and request["op"] == "set_state" and "base" in request:
            seen.append(request)
            if len(seen) == 2:
                ctx.pool.trainers[2] = Trainer(task)
        return None

    ctx = _ctx(task, _plan(bits=8), fail=restart)
    federated = meshkit.plugins.create("strategy", "federated", {"rounds": 4, "clients": 4})
    result = federated.run(ctx)
    assert result.rounds == 4
    to_two = [r for rank, r in _set_states(ctx.pool) if rank == 2]
    # whole, delta, delta (stale: a fresh process), whole again in round 3, delta in round 4
    assert ["base" in r for r in to_two] == [False, True, True, False, True]
    assert to_two[2]["digest"] == to_two[3]["digest"]
    for trainer in ctx.pool.trainers.values():
        assert trainer.digest == state_digest(trainer.state) == to_two[-1]["digest"]


def test_a_clients_evaluation_in_between_costs_a_whole_model_not_a_stale_round_trip():
    # evaluate = "both": the sampled clients evaluate the new global model, sent whole,
    # so the coordinator forgets what they held and sends the next round whole, unasked.
    task = _digits()
    ctx = _ctx(task, _plan(bits=8))
    federated = meshkit.plugins.create("strategy", "federated",
                                       {"rounds": 3, "clients": 4, "evaluate": "both"})
    result = federated.run(ctx)
    assert result.rounds == 3 and "client_accuracy" in result.metrics
    broadcast_sets = [r for _, r in _set_states(ctx.pool) if "digest" in r]
    assert len(broadcast_sets) == 6 and not any("base" in r for r in broadcast_sets)


def test_broadcast_must_be_true_or_false(tmp_path):
    config = write_config(tmp_path / "job.toml", tmp_path / "out", workers=2, rounds=1,
                          extra='clients = 2\n\n[compression]\nname = "quantize"\n'
                                'broadcast = "yes"\n')
    with pytest.raises(ConfigError, match=r"\[compression\] broadcast: expected true or false"):
        load_config(config)
    result = CliRunner().invoke(main, ["check", str(config)])
    assert result.exit_code == 2, result.output
    assert f"{config}: [compression] broadcast: expected true or false" in result.stderr


@pytest.mark.parametrize("strategy, tables, words", [
    ("fedbuff", "", ["broadcast = true with [strategy] name = 'fedbuff'",
                     "StrategyTraits.broadcast", "Drop broadcast"]),
    ("federated", '[secure_aggregation]\nname = "secagg+"\n\n',
     ["broadcast = true with [secure_aggregation]", "Drop broadcast"]),
    ("federated", '[privacy]\nname = "dp-fixed"\nclip_norm = 1.0\nnoise_multiplier = 1.0\n\n',
     ["broadcast = true with [privacy]", "Drop broadcast"]),
])
def test_what_cannot_broadcast_is_refused_naming_why(tmp_path, strategy, tables, words):
    config = write_config(tmp_path / "job.toml", tmp_path / "out", workers=2, rounds=1,
                          strategy=strategy, extra='clients = 4\n\n' + tables +
                          '[compression]\nname = "quantize"\nbroadcast = true\n')
    result = CliRunner().invoke(main, ["check", str(config)])
    assert result.exit_code == 2, result.output
    for word in words:
        assert word in result.stderr, (word, result.stderr)


def test_check_says_the_model_goes_down_as_a_delta(tmp_path):
    config = write_config(tmp_path / "job.toml", tmp_path / "out", workers=2, rounds=1,
                          extra='clients = 2\n' + BROADCAST)
    result = CliRunner().invoke(main, ["check", str(config)])
    assert result.exit_code == 0, result.output
    line = next(line for line in result.stdout.splitlines() if line.startswith("upload:"))
    assert "broadcast: the model goes down the same way" in line, line

# -- real processes: what the transport counted, kill and resume, accuracy -------------------



def _run(tmp_path, name, extra, rounds=3, **kwargs):
    config = write_config(tmp_path / f"{name}.toml", tmp_path / name, workers=2,
                          rounds=rounds, extra=extra, **kwargs)
    result = run_cli("run", str(config), cwd=str(tmp_path), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return read_metrics(tmp_path / name), result


@pytest.mark.slow
def test_the_transport_counts_the_broadcast_down_at_a_fraction_of_the_whole_model(tmp_path):
    whole, _ = _run(tmp_path, "whole", "clients = 2\n")
    upload, _ = _run(tmp_path, "int8", 'clients = 2\n\n[compression]\nname = "quantize"\n')
    both, result = _run(tmp_path, "bcast", "clients = 2\n" + BROADCAST)
    assert "sending the whole model" not in result.stdout + result.stderr
    down = {name: [r["bytes_down"] for r in rows]
            for name, rows in (("whole", whole), ("int8", upload), ("bcast", both))}
    # Round 1 sends the whole model everywhere; from round 2 a delta of one byte a
    # coordinate (the digits model is 2,410 float64: 19,280 bytes whole, to each of 2
    # workers), besides the fit requests, which are the same in all three.
    assert down["bcast"][0] == pytest.approx(down["whole"][0], rel=0.05)
    for later in (1, 2):
        assert down["bcast"][later] < 0.35 * down["whole"][later], down
        assert down["int8"][later] == pytest.approx(down["whole"][later], rel=0.05), down
    assert both[-1]["bytes_up"] == pytest.approx(upload[-1]["bytes_up"], rel=0.05)


@pytest.mark.slow
def test_digits_accuracy_with_a_compressed_broadcast_stays_within_a_point(tmp_path):
    extra = "clients = 10\n"
    plain, _ = _run(tmp_path, "plain", extra, rounds=12)
    both, _ = _run(tmp_path, "bcast", extra + BROADCAST, rounds=12)
    assert plain[-1]["accuracy"] > 0.85
    assert abs(both[-1]["accuracy"] - plain[-1]["accuracy"]) <= 0.01, (plain[-1], both[-1])


@pytest.mark.slow
def test_a_killed_and_resumed_broadcast_run_is_the_uninterrupted_runs_bit_for_bit(tmp_path):
    (tmp_path / "killer.py").write_text(KILLER)
    configs = {name: write_config(tmp_path / f"{name}.toml", tmp_path / name, workers=2,
                                  rounds=4, task="killer:Killer",
                                  extra="clients = 4\n" + BROADCAST)
               for name in ("straight", "crashed")}
    env = {"PYTHONPATH": str(tmp_path)}
    first = run_cli("run", str(configs["crashed"]), cwd=str(tmp_path), timeout=180,
                    env={**env, "KILL_AT_FIT": "5", "KILL_MARK": str(tmp_path / "killed")})
    assert first.returncode == -signal.SIGKILL, first.stdout + first.stderr
    killed_after = load_checkpoint(tmp_path / "crashed").round
    assert 1 <= killed_after < 4
    # The checkpoint keeps the model the workers held (the strategy's state).
    held = load_checkpoint(tmp_path / "crashed").strategy_state["broadcast"]["model"]
    assert sorted(held) == sorted(load_checkpoint(tmp_path / "crashed").state)
    resumed = run_cli("run", str(configs["crashed"]), "--resume", cwd=str(tmp_path),
                      timeout=180, env=env)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    whole = run_cli("run", str(configs["straight"]), cwd=str(tmp_path), timeout=180, env=env)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    a, b = load_checkpoint(tmp_path / "crashed"), load_checkpoint(tmp_path / "straight")
    assert a.round == b.round == 4
    for key in b.state:
        assert a.state[key].tobytes() == b.state[key].tobytes(), key
    for key, value in b.strategy_state["broadcast"]["model"].items():
        assert a.strategy_state["broadcast"]["model"][key].tobytes() == value.tobytes(), key
    rows = [r for r in read_metrics(tmp_path / "crashed") if r["round"] > killed_after]
    assert [r["round"] for r in rows] == list(range(killed_after + 1, 5))
    straight = {r["round"]: r for r in read_metrics(tmp_path / "straight")}
    # The first round after the resume sends its fresh workers the held model whole; the
    # later ones a delta, as the uninterrupted run does.
    assert rows[0]["bytes_down"] > 1.5 * straight[rows[0]["round"]]["bytes_down"], rows[0]
    for row in rows[1:]:
        assert row["bytes_down"] == pytest.approx(straight[row["round"]]["bytes_down"],
                                                  rel=0.05)
