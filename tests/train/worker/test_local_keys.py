"""[strategy] local_keys (FedBN): which keys stay on each client, where their values live,
that they are never aggregated, and that each client fits and evaluates with its own."""

from __future__ import annotations

import numpy as np
import pytest

import meshkit
import meshkit.plugins
from meshkit.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from meshkit.errors import ConfigError, StateError
from meshkit.task import FitResult
from meshkit.train import ClientLocal, LocalPool, StrategyContext, resolve_local_keys


class Drifting:
    """'w' learns the shard mean; 'norm.stat' accumulates the shard's own mean each fit,
    so a client's value says whose fits it went through."""

    groups = {"norm": ["norm.stat"]}

    def __init__(self) -> None:
        self.x = np.arange(8, dtype=np.float64).reshape(8, 1)
        self.y = np.zeros(8)
        self.evaluated: list[float] = []

    def init_state(self, seed):
        return {"w": np.zeros(1), "norm.stat": np.zeros(1), "meta": {"v": 1}}

    def key_groups(self):
        return self.groups

    def train_data(self):
        return self.x, self.y

    def test_data(self):
        return self.x, self.y

    def fit(self, state, x, y, *, seed):
        return FitResult({"w": np.array([x.mean()]),
                          "norm.stat": np.asarray(state["norm.stat"]) + x.mean(),
                          "meta": {"v": 1}}, len(x), {})

    def evaluate(self, state, x=None, y=None):
        return {"stat": float(np.asarray(state["norm.stat"])[0])}


def run(local_keys, rounds=2, evaluate="clients"):
    task = Drifting()
    reports = []
    ctx = StrategyContext(task=task, aggregator=meshkit.plugins.create("aggregator", "fedavg"),
                          pool=LocalPool.of(Drifting, [1, 2]), workers=[1, 2],
                          rng=np.random.default_rng(0),
                          outer=meshkit.plugins.create("outer_optimizer", "average"),
                          on_round=lambda report, state: reports.append((report, dict(state))))
    strategy = meshkit.plugins.create("strategy", "federated", {
        "rounds": rounds, "clients": 2, "evaluate": evaluate, "local_keys": local_keys})
    result = strategy.run(ctx)
    return ctx, result, reports


def test_local_keys_stay_with_each_client_and_are_never_averaged():
    # Shards 0..3 and 4..7: means 1.5 and 5.5.
    ctx, result, reports = run(["@norm"])
    assert ctx.client_local.keys == {"norm.stat"}
    own = {c: float(ctx.client_local.of(c)["norm.stat"][0]) for c in (0, 1)}
    assert own == {0: 3.0, 1: 11.0}, "each client went on from its own value, twice"
    assert float(result.state["w"][0]) == pytest.approx(3.5), "the rest is still fedavg"
    assert float(result.state["norm.stat"][0]) == 0.0, "the global model never takes them"
    fits = [req for _, req in ctx.pool.log if req["op"] == "fit"]
    assert "local" not in fits[0] and "local" not in fits[1]
    assert {float(r["local"]["norm.stat"][0]) for r in fits[2:]} == {1.5, 5.5}
    # Clients evaluate with their own values: 1.5 and 5.5 after round 1.
    report, _ = reports[0]
    assert {c: m["stat"] for c, m in report.client_metrics.items()} == {0: 1.5, 1: 5.5}


def test_without_local_keys_the_same_keys_are_averaged():
    ctx, result, _ = run([])
    assert not ctx.client_local
    assert float(result.state["norm.stat"][0]) == pytest.approx(3.5 + 3.5)


def test_local_keys_take_globs_and_refuse_what_names_nothing():
    task, state = Drifting(), Drifting().init_state(0)
    assert resolve_local_keys(["norm.*"], state, task) == {"norm.stat"}
    assert resolve_local_keys(["@norm", "w"], state, task) == {"norm.stat", "w"}
    with pytest.raises(ConfigError, match=r"'bn\.\*' matches no array of the model"):
        resolve_local_keys(["bn.*"], state, task)
    with pytest.raises(ConfigError, match=r"'@bn' names a key group the task .* offers: "
                                          r"\"@norm\""):
        resolve_local_keys(["@bn"], state, task)


def test_local_keys_need_the_clients_to_evaluate():
    with pytest.raises(ConfigError, match=r"local_keys .* set evaluate = \"clients\""):
        run(["@norm"], evaluate="coordinator")


def test_each_clients_local_values_survive_a_checkpoint(tmp_path):
    ctx, result, _ = run(["@norm"], rounds=1)
    save_checkpoint(tmp_path, Checkpoint(round=1, state=result.state,
                                         clients=ctx.client_local.state_dict()))
    restored = ClientLocal()
    restored.load_state_dict(load_checkpoint(tmp_path).clients)
    restored.use(frozenset({"norm.stat"}))
    assert {c: float(restored.of(c)["norm.stat"][0]) for c in (0, 1)} == {0: 1.5, 1: 5.5}
    with pytest.raises(StateError, match="local_keys no longer names"):
        restored.use(frozenset({"w"}))


@pytest.mark.slow
def test_a_run_checkpoints_each_clients_local_keys_and_resume_continues_them(tmp_path):
    table = {"run": {"out": str(tmp_path / "out"), "seed": 1},
             "mesh": {"workers": 2, "timeout": 20.0},
             "strategy": {"name": "federated", "rounds": 1, "clients": 3,
                          "evaluate": "clients", "local_keys": ["hidden.*"]}}
    first = meshkit.run(table)
    ckpt = load_checkpoint(tmp_path / "out")
    kept = ClientLocal()
    kept.load_state_dict(ckpt.clients)
    assert kept.clients == 3
    for c in range(3):  # each client's own hidden layer, not the global model's
        assert sorted(kept.of(c)) == ["hidden.b", "hidden.w"]
        assert not np.array_equal(kept.of(c)["hidden.w"], first.state["hidden.w"])
    table["strategy"]["rounds"] = 2
    second = meshkit.run(table, resume=True)
    assert second.ok and second.rounds_completed == 2
    assert np.array_equal(second.state["hidden.w"], first.state["hidden.w"]), (
        "the global model never takes the local keys")


def _values(client):
    return {"bn.mean": np.full(16, client, np.float32), "bn.var": np.arange(16.0) * client,
            "w": np.zeros(3)}


def test_client_values_are_packed_records_that_spill_to_the_run_directory(tmp_path):
    import tracemalloc

    local = ClientLocal(frozenset({"bn.mean", "bn.var"}), spill_dir=tmp_path,
                        memory_bytes=16 * 1024)
    for c in range(64):
        local.keep(c, _values(c))
    tracemalloc.start()
    for c in range(64, 4_000):
        assert sorted(local.keep(c, _values(c))) == ["w"]  # the rest is what is folded
    grown = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    # 4,000 records of 192 bytes are 768 KB; held here is the index (8 bytes a client)
    assert local.spilled and (tmp_path / "client_local.bin").exists()
    assert grown < 150_000, f"keeping 4,000 clients' values allocated {grown} bytes"
    assert local.clients == 4_000
    for c in (0, 63, 1_234, 3_999):
        assert np.array_equal(local.of(c)["bn.var"], _values(c)["bn.var"])
        assert local.of(c)["bn.mean"].dtype == np.float32
    assert local.of(4_000) == {}
    again = ClientLocal(spill_dir=tmp_path / "elsewhere")
    (tmp_path / "elsewhere").mkdir()
    again.load_state_dict(local.state_dict())
    again.use(frozenset({"bn.mean", "bn.var"}))
    assert np.array_equal(again.of(1_234)["bn.mean"], _values(1_234)["bn.mean"])


def test_a_checkpoint_from_before_the_records_were_packed_still_resumes():
    local = ClientLocal()
    local.load_state_dict({f"{c}/bn.mean": np.full(2, float(c)) for c in (3, 7)})
    local.use(frozenset({"bn.mean"}))
    assert local.clients == 2 and float(local.of(7)["bn.mean"][0]) == 7.0


def test_a_client_whose_local_key_changes_shape_is_refused():
    local = ClientLocal(frozenset({"bn.mean"}))
    local.keep(0, {"bn.mean": np.zeros(4)})
    with pytest.raises(StateError, match=r"client 1's local key 'bn.mean' is float64\[5\]"):
        local.keep(1, {"bn.mean": np.zeros(5)})
