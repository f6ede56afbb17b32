"""The ``synthetic`` task's free fit (``noise = 0``): the state given back, nothing drawn.

``benchmarks/large_model.py --noise 0`` times a round whose fits cost nothing, so
what it measures is the mesh's transfer and fold (issue 39). The fit must then
return the arrays it was given, not a perturbed copy of them, and a real round
over TCP must carry them back as the worker's contribution.
"""

from __future__ import annotations

import threading

import numpy as np

import meshkit.plugins
from meshkit.node.config import NodeConfig
from meshkit.train import GroupPool, StrategyContext, serve_trainer
from meshkit_tasks.synthetic import SyntheticOptions, SyntheticTask

SECRET = b"synthetic-free-fit-secret"


def test_a_free_fit_returns_the_arrays_it_was_given():
    task = SyntheticTask(SyntheticOptions(params=1000, arrays=3, noise=0.0))
    state = task.init_state(7)
    x, y = task.train_data()
    got = task.fit(state, x[:100], y[:100], seed=3)
    assert sorted(got.state) == sorted(state)
    for key, value in state.items():
        # The same memory: no noise drawn, nothing copied.
        assert np.shares_memory(got.state[key], value)
        np.testing.assert_array_equal(got.state[key], value)
    assert got.examples == 100
    assert got.metrics == {"train_loss": 0.0}


def test_a_free_fit_gives_the_values_the_perturbation_at_zero_would():
    free = SyntheticTask(SyntheticOptions(params=999, arrays=2, dtype="float16", noise=0.0))
    state = free.init_state(1)
    x, y = free.train_data()
    got = free.fit(state, x, y, seed=5)
    drawn = free._perturbed(state, 5, 0.0)
    for key in state:
        assert got.state[key].dtype == np.float16
        np.testing.assert_array_equal(got.state[key], drawn[key])


def test_a_noisy_fit_still_moves_the_state():
    task = SyntheticTask(SyntheticOptions(params=1000, noise=0.01))
    state = task.init_state(7)
    x, y = task.train_data()
    got = task.fit(state, x, y, seed=3)
    assert not np.shares_memory(got.state["w0"], state["w0"])
    assert not np.array_equal(got.state["w0"], state["w0"])


def test_free_fits_round_trip_over_tcp_and_leave_the_model_where_it_was(monkeypatch):
    """Two workers over real TCP, 2 rounds: each contribution is the state it was sent
    (views of the received body, sent back as they are), so the mean is that state."""
    shared: list[bool] = []
    fit = SyntheticTask.fit

    def watched_fit(self, state, x, y, *, seed):
        got = fit(self, state, x, y, seed=seed)
        shared.append(all(np.shares_memory(got.state[k], state[k]) for k in state))
        return got

    monkeypatch.setattr(SyntheticTask, "fit", watched_fit)
    spec = {"task": "synthetic",
            "task_options": {"params": 300_000, "arrays": 2, "noise": 0.0},
            "strategy": "federated", "seed": 0}
    hub = NodeConfig(rank=0, world=3, topology="star", bind="127.0.0.1:0", secret=SECRET,
                     timeout=30.0, segment_bytes=256 << 10).connect()
    workers = [NodeConfig(rank=r, world=3, peers=[hub.address], topology="star",
                          secret=SECRET, timeout=30.0, segment_bytes=256 << 10).connect()
               for r in (1, 2)]
    threads = [threading.Thread(target=serve_trainer, args=(g, spec), daemon=True)
               for g in workers]
    try:
        for t in threads:
            t.start()
        assert hub.wait_for_workers(timeout=10) == [1, 2]
        task = meshkit.plugins.create("task", "synthetic", spec["task_options"])
        ctx = StrategyContext(
            task=task, aggregator=meshkit.plugins.create("aggregator", "fedavg"),
            pool=GroupPool(hub), workers=[1, 2], rng=np.random.default_rng(0),
            outer=meshkit.plugins.create("outer_optimizer", "average"), timeout=30.0)
        result = meshkit.plugins.create("strategy", "federated", {"rounds": 2}).run(ctx)
        ctx.pool.stop_all([1, 2])
        for t in threads:
            t.join(20)
    finally:
        for group in (*workers, hub):
            group.close()
    assert result.rounds == 2
    assert shared == [True] * 4  # every fit sent back the body it was given
    start = task.init_state(0)  # the context's seed
    for key, value in start.items():
        np.testing.assert_allclose(np.asarray(result.state[key]), value, rtol=1e-6, atol=0)
