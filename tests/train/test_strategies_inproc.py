"""Strategies over a real Group (the inproc transport): the trainer protocol end to end."""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest

import meshkit.plugins
from meshkit.node.config import NodeConfig
from meshkit.train import StrategyContext
from meshkit.train import GroupPool, serve_trainer

SECRET = b"s" * 32
SPEC = {"task": "digits", "task_options": {"epochs": 1}, "strategy": "federated", "seed": 0}


def connect(rank: int, world: int, hub: str, timeout: float = 5.0):
    cfg = NodeConfig(rank=rank, world=world, peers=[hub], transport="inproc", secret=SECRET,
                     timeout=timeout, topology="star")
    return meshkit.plugins.create("transport", "inproc").connect(cfg)


@pytest.fixture
def mesh():
    """A coordinator and worker groups on one inproc hub; workers start on demand."""
    hub = f"inproc://{uuid.uuid4().hex}"
    made = []
    threads = []
    reports = {}

    def start(world, serve=(), timeout=5.0):
        groups = {}

        def join(rank):
            groups[rank] = connect(rank, world, hub, timeout)

        joiners = [threading.Thread(target=join, args=(r,)) for r in range(world)]
        for t in joiners:
            t.start()
        for t in joiners:
            t.join(10)
        made.extend(groups.values())
        for rank in serve:
            t = threading.Thread(
                target=lambda r=rank: reports.__setitem__(r, serve_trainer(groups[r], SPEC)),
                daemon=True)
            t.start()
            threads.append(t)
        groups[0].wait_for_workers(10)
        return groups

    yield start, reports, threads
    for g in made:
        g.close()
    for t in threads:
        t.join(10)


def context(coordinator, workers, timeout=5.0, **kw):
    task = meshkit.plugins.create("task", "digits", SPEC["task_options"])
    return StrategyContext(
        task=task, aggregator=meshkit.plugins.create("aggregator", "fedavg"),
        pool=GroupPool(coordinator), workers=list(workers), rng=np.random.default_rng(0),
        outer=meshkit.plugins.create("outer_optimizer", "average"), timeout=timeout, **kw)


def test_federated_over_a_group_trains_and_workers_report(mesh):
    start, reports, threads = mesh
    groups = start(3, serve=(1, 2))
    ctx = context(groups[0], [1, 2])
    result = meshkit.plugins.create("strategy", "federated", {"rounds": 3}).run(ctx)
    assert result.metrics["accuracy"] > 0.7
    ctx.pool.stop_all([1, 2])
    for t in threads:
        t.join(10)
    assert {r: (rep.rounds, rep.stopped) for r, rep in reports.items()} == {
        1: (3, None), 2: (3, None)}


def test_the_group_path_equals_the_in_process_path_bit_for_bit(mesh):
    from meshkit.train import LocalPool

    start, _, _ = mesh
    groups = start(3, serve=(1, 2))
    over_wire = meshkit.plugins.create("strategy", "federated", {"rounds": 2}).run(
        context(groups[0], [1, 2]))
    local_ctx = context(groups[0], [1, 2])
    local_ctx.pool = LocalPool.of(
        lambda: meshkit.plugins.create("task", "digits", SPEC["task_options"]), [1, 2])
    in_process = meshkit.plugins.create("strategy", "federated", {"rounds": 2}).run(local_ctx)
    for key, value in in_process.state.items():
        assert np.array_equal(over_wire.state[key], value), key


def test_a_stalled_worker_is_dropped_after_the_timeout_and_the_round_completes(mesh):
    start, _, _ = mesh
    # Rank 3 joins but never serves: it stalls every request.
    groups = start(4, serve=(1, 2), timeout=1.0)
    reports = []
    ctx = context(groups[0], [1, 2, 3], timeout=0.5,
                  on_round=lambda report, state: reports.append(report))
    meshkit.plugins.create("strategy", "federated", {"rounds": 2, "min_clients": 2}).run(ctx)
    assert reports[0].answered == (1, 2) and reports[0].dropped == (3,)
    assert "stalled" in ctx.drop_reasons[3]
    assert 3 in groups[0].dead, "the transport's ledger hears about the drop"
    assert reports[1].answered == (1, 2)
