"""Federated rounds over a partitioner, in-process (LocalPool): bits, pinning, client evaluation."""

from __future__ import annotations

import numpy as np
import pytest

import meshkit
from meshkit import ConfigError
from meshkit.task import FitResult
from meshkit.train import LocalPool, StrategyContext, Trainer


class OwnRows:
    """A node's own rows ``start..start+rows``; the 'model' is the mean of what it fit."""

    def __init__(self, start: int, rows: int, held_out: int = 2) -> None:
        self.x = np.arange(start, start + rows, dtype=np.float64).reshape(rows, 1)
        self.y = np.zeros(rows, dtype=np.int64)
        self.held = held_out

    def init_state(self, seed):
        return {"m": np.zeros(1)}

    def train_data(self):
        return self.x, self.y

    def test_data(self):
        return self.x[:self.held], self.y[:self.held]

    def fit(self, state, x, y, *, seed):
        return FitResult({"m": np.array([x.mean()])}, len(x), {"train_loss": 0.0})

    def evaluate(self, state, x=None, y=None):
        x = self.x[:self.held] if x is None else x
        return {"gap": float(abs(np.asarray(state["m"])[0] - x.mean()))}


def _partitioner(name, **options):
    return meshkit.plugins.create("partitioner", name, options)


def _ctx(trainers, partitioner=None, **kw):
    ranks = sorted(trainers)
    defaults = dict(task=next(iter(trainers.values())).task,
                    aggregator=meshkit.plugins.create("aggregator", "fedavg"),
                    pool=LocalPool(trainers, **kw.pop("pool", {})), workers=ranks,
                    rng=np.random.default_rng(0),
                    outer=meshkit.plugins.create("outer_optimizer", "average"),
                    partitioner=partitioner)
    defaults.update(kw)
    return StrategyContext(**defaults)


def _federated(**options):
    return meshkit.plugins.create("strategy", "federated", options)


def _digits_trainers(partitioner=None, ranks=(1, 2)):
    from meshkit_tasks.digits import DigitsTask

    return {r: Trainer(DigitsTask(), partitioner=partitioner,
                       partitioner_name="x") for r in ranks}


def test_the_contiguous_partitioner_keeps_a_run_bit_identical():
    before = _federated(rounds=2, clients=3).run(_ctx(_digits_trainers()))
    after = _federated(rounds=2, clients=3).run(
        _ctx(_digits_trainers(_partitioner("contiguous"))))
    for key, value in before.state.items():
        assert np.asarray(after.state[key]).tobytes() == np.asarray(value).tobytes()


def test_rounds_record_each_clients_examples_from_the_partitioner():
    partitioner = _partitioner("dirichlet", alpha=0.5)
    reports = []
    ctx = _ctx(_digits_trainers(partitioner), partitioner=partitioner,
               on_round=lambda report, state: reports.append(report))
    _federated(rounds=1, clients=4).run(ctx)
    labels = ctx.task.train_data()[1]
    parts = partitioner.split(labels, 4, seed=0)
    assert reports[0].client_examples == {c: len(p) for c, p in enumerate(parts)}
    assert reports[0].to_json()["client_examples"] == {str(c): len(p)
                                                        for c, p in enumerate(parts)}


def _local_nodes(*tasks: object) -> tuple[dict[int, object], object]:
    """Ranks 1.. each training on its own task's rows, under the ``local`` partitioner."""
    partitioner = _partitioner("local")
    return ({r: Trainer(task, partitioner=partitioner) for r, task in enumerate(tasks, 1)},
            partitioner)


def test_with_local_data_each_client_is_served_by_its_own_node_only():
    trainers, partitioner = _local_nodes(OwnRows(0, 4), OwnRows(100, 6))
    reports = []
    ctx = _ctx(trainers, partitioner=partitioner,
               on_round=lambda report, state: reports.append(report))
    result = _federated(rounds=1).run(ctx)
    assert reports[0].served == {0: 1, 1: 2}
    assert reports[0].client_examples == {0: 4, 1: 6}
    # fedavg of the two nodes' own means (1.5 and 102.5), weighted 4 : 6.
    assert float(result.state["m"][0]) == pytest.approx((4 * 1.5 + 6 * 102.5) / 10)


def test_a_lost_node_with_local_data_leaves_its_client_unserved():
    trainers, partitioner = _local_nodes(OwnRows(0, 4), OwnRows(100, 6))
    reports = []

    def fail(rank, request):
        return "killed" if rank == 2 and request.get("op") == "fit" else None

    ctx = _ctx(trainers, partitioner=partitioner, pool={"fail": fail},
               on_round=lambda report, state: reports.append(report))
    result = _federated(rounds=1).run(ctx)
    assert reports[0].served == {0: 1}
    assert "its data is on rank 2, which was lost" in reports[0].not_served[1]
    assert float(result.state["m"][0]) == pytest.approx(1.5)  # never another node's rows


def test_clients_evaluate_on_their_own_held_out_data():
    trainers, partitioner = _local_nodes(OwnRows(0, 4, held_out=2),
                                         OwnRows(100, 6, held_out=3))
    reports = []
    ctx = _ctx(trainers, partitioner=partitioner,
               on_round=lambda report, state: reports.append(report))
    _federated(rounds=1, evaluate="clients").run(ctx)
    report = reports[0]
    m = (4 * 1.5 + 6 * 102.5) / 10
    gaps = {0: abs(m - 0.5), 1: abs(m - 101.0)}
    assert report.client_metrics[0] == {"gap": pytest.approx(gaps[0]), "examples": 2.0}
    assert report.client_metrics[1] == {"gap": pytest.approx(gaps[1]), "examples": 3.0}
    assert report.metrics["client_gap"] == pytest.approx((2 * gaps[0] + 3 * gaps[1]) / 5)
    assert "gap" not in report.metrics  # the coordinator evaluated nothing


def test_evaluate_on_clients_is_refused_before_any_fit_when_a_node_has_no_held_out_data():
    trainers = {1: Trainer(OwnRows(0, 4)), 2: Trainer(OwnRows(100, 6, held_out=0))}
    ctx = _ctx(trainers)
    with pytest.raises(ConfigError, match="rank 2 has no held-out data"):
        _federated(rounds=1, evaluate="clients").run(ctx)
    assert not [r for _, r in ctx.pool.log if r.get("op") == "fit"]


def test_local_partitioner_refuses_a_clients_count_other_than_the_workers():
    with pytest.raises(ConfigError, match="clients = 3, but with .*local.* 2 workers"):
        _federated(clients=3).check(task=OwnRows(0, 4), outer_name="average", workers=2,
                                    partitioner=_partitioner("local"))
