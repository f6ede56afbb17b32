"""Realized work: a time budget per fit, weighed by the examples done; a round deadline that drops late answers."""

from __future__ import annotations

import itertools
import threading
import uuid

import attrs
import numpy as np
import pytest

import meshkit.plugins
from meshkit import ConfigError
from meshkit.aggregation import FixedPointSum
from meshkit.compression import CompressionPlan, decode_contribution
from meshkit.node.config import NodeConfig
from meshkit.task import FitResult
from meshkit.train import (
    GroupPool,
    LocalPool,
    StrategyContext,
    Trainer,
    Work,
    client_seed,
    fold_round,
    serve_trainer,
    shard_pair,
)
from meshkit_strategies.federated import Federated
from meshkit_strategies.options import FederatedOptions

SECRET = b"s" * 32


def digits():
    return meshkit.plugins.create("task", "digits", {"batch_size": 32})


def fits(clients, rnd=1, **extra):
    return [Work(c, {"op": "fit", "shard": c, "shards": clients,
                     "seed": client_seed(7, rnd, c), **extra}) for c in range(clients)]


class Recording:
    """A fold that records each contribution's weight, then defers to fedavg's fold."""

    def __init__(self) -> None:
        self.inner = meshkit.plugins.create("aggregator", "fedavg").begin()
        self.weights: dict[str, float] = {}

    def add(self, state, weight, source=""):
        self.weights[source] = weight
        self.inner.add(state, weight, source=source)

    def result(self):
        return self.inner.result()


def ticking(step: float):
    """A fake clock that advances ``step`` seconds each time it is read."""
    counter = itertools.count()
    return lambda: next(counter) * step


# -- time budget -----------------------------------------------------------------


def test_a_slowed_client_contributes_fewer_examples_and_weighs_exactly_them():
    ranks = [1, 2]
    pool = LocalPool({r: Trainer(digits()) for r in ranks})
    # Rank 2's batches "take" a second each on its clock; rank 1's nothing.
    pool.trainers[1].task.clock = lambda: 0.0
    pool.trainers[2].task.clock = ticking(1.0)
    ctx = StrategyContext(task=digits(), aggregator=meshkit.plugins.create("aggregator", "fedavg"),
                          pool=pool, workers=ranks, rng=np.random.default_rng(0), timeout=30.0)
    fold = Recording()
    state = ctx.task.init_state(0)
    folded = fold_round(ctx, fits(2, time_budget=2.5), state=state, fold=fold)
    assert folded.served == {0: 1, 1: 2}
    fast, slow = folded.replies[0]["examples"], folded.replies[1]["examples"]
    shard = len(ctx.task.train_data()[1]) // 2
    assert fast == shard  # the whole shard, once (epochs = 1)
    assert slow == 3 * 32 < fast  # batches started at t = 0, 1, 2; t = 3 is past 2.5
    assert fold.weights == {"client 0 (rank 1)": fast, "client 1 (rank 2)": slow}
    assert folded.examples == fast + slow


def test_without_a_budget_a_fit_is_unchanged():
    task = digits()
    x, y = task.train_data()
    state = task.init_state(0)
    plain = task.fit(state, x, y, seed=3)
    task.clock = ticking(1.0)
    generous = task.fit(state, x, y, seed=3, time_budget=1e6)
    assert plain.examples == generous.examples == len(y)
    assert all(np.array_equal(plain.state[k], generous.state[k]) for k in plain.state)
    assert plain.metrics == generous.metrics


def test_a_budget_always_trains_one_batch():
    task = digits()
    task.clock = ticking(100.0)
    x, y = task.train_data()
    assert task.fit(task.init_state(0), x, y, seed=0, time_budget=0.001).examples == 32


def test_a_budget_that_runs_out_in_a_later_pass_counts_every_row_trained_on():
    # Two passes over 100 rows in batches of 32 (32, 32, 32, 4): the clock is
    # read once before each batch, so a budget of 5.5 ticks trains six batches,
    # the whole first pass and the first two of the second.
    task = meshkit.plugins.create("task", "digits", {"batch_size": 32, "epochs": 2})
    x, y = (a[:100] for a in task.train_data())
    task.clock = ticking(1.0)
    budgeted = task.fit(task.init_state(0), x, y, seed=0, time_budget=5.5)
    assert budgeted.examples == 100 + 64
    assert task.fit(task.init_state(0), x, y, seed=0).examples == 200


@attrs.frozen
class NoBudgetOptions:
    pass


class NoBudgetTask:
    def init_state(self, seed):
        return {}

    def train_data(self):
        return np.zeros((4, 1)), np.zeros(4)

    def fit(self, state, x, y, *, seed):
        return FitResult({}, len(y))

    def evaluate(self, state):
        return {}


def test_a_task_that_cannot_honour_a_time_budget_is_refused_at_start():
    strategy = Federated(FederatedOptions(time_budget=5.0))
    with pytest.raises(ConfigError, match=r"time_budget = 5: the task \(NoBudgetTask\) cannot "
                                          r"honour a time budget: its fit\(\) takes no "
                                          r"time_budget argument"):
        strategy.check(task=NoBudgetTask(), outer_name="average", workers=2)
    Federated(FederatedOptions(time_budget=5.0)).check(task=digits(), outer_name="average",
                                                       workers=2)


# -- round deadline --------------------------------------------------------------

#: Released by the test once the round that rank 2 is late for is over.
GATE = threading.Event()


@attrs.frozen
class GatedOptions:
    gated: bool = False


class GatedTask:
    """digits whose first fit, with ``gated``, waits for :data:`GATE` (a straggler)."""

    Options = GatedOptions

    def __init__(self, options: GatedOptions) -> None:
        self.inner = digits()
        self.waits = 1 if options.gated else 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def fit(self, state, x, y, *, seed):
        if self.waits:
            self.waits -= 1
            assert GATE.wait(30), "the test never released the straggler"
        return self.inner.fit(state, x, y, seed=seed)


@pytest.fixture
def star():
    """A coordinator and two trainer ranks over the inproc transport; rank 2 straggles once."""
    hub = f"inproc://{uuid.uuid4().hex}"
    GATE.clear()
    groups: dict[int, object] = {}

    def join(rank: int) -> None:
        cfg = NodeConfig(rank=rank, world=3, peers=[hub], transport="inproc", secret=SECRET,
                         timeout=20.0, topology="star")
        groups[rank] = meshkit.plugins.create("transport", "inproc").connect(cfg)

    joiners = [threading.Thread(target=join, args=(r,)) for r in range(3)]
    for t in joiners:
        t.start()
    for t in joiners:
        t.join(10)
    reports: dict[int, object] = {}
    threads = []
    for rank in (1, 2):
        spec = {"task": f"{__name__}:GatedTask", "task_options": {"gated": rank == 2},
                "strategy": "federated", "seed": 0}
        t = threading.Thread(target=lambda r=rank, s=spec: reports.__setitem__(
            r, serve_trainer(groups[r], s)), daemon=True)
        t.start()
        threads.append(t)
    groups[0].wait_for_workers(10)
    yield groups[0]
    GATE.set()
    GroupPool(groups[0]).stop_all([1, 2])
    for t in threads:
        t.join(10)
    for g in groups.values():
        g.close()


def test_a_late_answer_is_dropped_for_its_round_only_and_the_worker_serves_the_next(star):
    pool = GroupPool(star)
    task = digits()
    ctx = StrategyContext(task=task, aggregator=meshkit.plugins.create("aggregator", "fedavg"),
                          pool=pool, workers=[1, 2], rng=np.random.default_rng(0),
                          timeout=20.0)
    state = task.init_state(0)
    first = fold_round(ctx, fits(2, rnd=1), state=state, deadline=1.0)
    assert first.served == {0: 1}
    assert first.late == {1: 2}
    assert first.not_served[1].startswith("late: rank 2 no answer within round_timeout = 1 s")
    assert first.outcome(state, {}).late == (2,)
    assert ctx.dead == {} and ctx.live == [1, 2]  # late is not dead
    GATE.set()  # the straggler finishes its round-1 fit now: that answer must be discarded
    # Flat again (the batched round would fold on the workers): the mean below
    # is the flat fold's, to the bit of its float32 accumulation.
    second = fold_round(ctx, fits(2, rnd=2), state=first.result, deadline=None, batch=False)
    assert second.served == {0: 1, 1: 2} and second.late == {} and second.not_served == {}
    assert pool.pending == 0
    # Client 1's round-2 contribution is round 2's fit, not the late round-1 one.
    x, y = task.train_data()
    xs, ys = shard_pair(x, y, 2)
    want = task.fit(first.result, xs[1], ys[1], seed=client_seed(7, 2, 1))
    mine = digits().fit(first.result, xs[0], ys[0], seed=client_seed(7, 2, 0))
    mean = {k: (mine.state[k] * mine.examples + want.state[k] * want.examples)
            / (mine.examples + want.examples) for k in want.state}
    for key, value in second.result.items():
        np.testing.assert_allclose(value, mean[key], rtol=1e-12)


def test_a_round_deadline_needs_a_non_negative_number_of_seconds():
    ctx = StrategyContext(task=digits(), aggregator=meshkit.plugins.create("aggregator", "fedavg"),
                          pool=LocalPool.of(digits, [1]), workers=[1],
                          rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match="deadline must be a number of seconds >= 0"):
        fold_round(ctx, fits(1), state=ctx.task.init_state(0), deadline=-1.0)


def _exact_of_payloads(plan, state, works, raw):
    """The exact sum (FixedPointSum) of ``works``' compressed fits, each decoded whole at the
    coordinator: what the flat compressed round's chunked sum must equal, bit for bit."""
    total = FixedPointSum()
    for work in works:
        trainer = Trainer(digits())
        trainer.handle({"op": "set_state", "state": state})
        reply = trainer.handle({**work.request, "compress": plan.request(raw)})
        decoded, _ = decode_contribution(plan.compressor, reply["state"], state, raw=raw)
        total.add(decoded, reply["examples"], source=f"client {work.key}")
    return total.result()


def test_a_compressed_flat_round_leaves_a_late_payload_out_of_its_exact_sum(star):
    pool = GroupPool(star)
    task = digits()
    plan = CompressionPlan("quantize", {"bits": 8},
                           meshkit.plugins.create("compression", "quantize", {"bits": 8}))
    ctx = StrategyContext(task=task, aggregator=meshkit.plugins.create("aggregator", "fedavg"),
                          pool=pool, workers=[1, 2], rng=np.random.default_rng(0),
                          timeout=20.0, compression=plan)
    state = task.init_state(0)
    raw = sorted(ctx.buffers & set(state))
    first = fold_round(ctx, fits(2, rnd=1), state=state, deadline=1.0)
    assert first.served == {0: 1} and first.late == {1: 2}
    assert ctx.dead == {} and ctx.live == [1, 2]
    got = first.result
    want = _exact_of_payloads(plan, state, fits(2, rnd=1)[:1], raw)
    assert got.keys() == want.keys()
    assert all(got[k].tobytes() == want[k].tobytes() for k in want)
    GATE.set()  # the straggler's late round-1 payload must be discarded, never summed
    second = fold_round(ctx, fits(2, rnd=2), state=first.result, deadline=None, batch=False)
    assert second.served == {0: 1, 1: 2} and second.late == {} and pool.pending == 0
    want = _exact_of_payloads(plan, first.result, fits(2, rnd=2), raw)
    assert all(second.result[k].tobytes() == want[k].tobytes() for k in want)
