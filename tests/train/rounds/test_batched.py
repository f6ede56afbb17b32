"""The batched round in-process: workers fold their own clients exactly; the bits never move."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

import meshkit.plugins
from meshkit.aggregation import FixedPointSum, MeanFold
from meshkit.errors import AggregationError
from meshkit.train import LocalPool, StrategyContext, Trainer, Work, client_seed, fold_round
from meshkit.train._rounds.batched import BATCHES_PER_WORKER, batch_applies

from tests.support.rounds import fits, make_ctx, same_bytes, synthetic


def ops(ctx: StrategyContext) -> list[str]:
    return [request["op"] for _, request in ctx.pool.log]


def by_hand(ctx: StrategyContext, state: dict, clients: int) -> dict:
    """The round as one exact sum of every client's fit: what any split must give."""
    total = FixedPointSum()
    x, y = ctx.task.train_data()
    for c in range(clients):
        trainer = Trainer(synthetic())
        trainer.handle({"op": "set_state", "state": state})
        reply = trainer.handle({"op": "fit", "shard": c, "shards": clients,
                                "seed": client_seed(7, 1, c)})
        total.add(reply["state"], float(reply["examples"]))
    return total.result()


def test_any_worker_count_and_arrival_order_give_the_bits_of_one_exact_sum():
    state = make_ctx().task.init_state(0)
    expected = by_hand(make_ctx(), state, 9)
    for workers, shuffle in ((1, None), (2, 5), (3, 6), (4, 7)):
        ctx = make_ctx(workers=workers, order=None if shuffle is None
                       else np.random.default_rng(shuffle))
        folded = fold_round(ctx, fits(9), state=state)
        assert "fit_batch" in ops(ctx) and "take" not in ops(ctx)
        assert list(folded.served) == list(range(9)) and folded.not_served == {}
        assert same_bytes(folded.result, expected), (workers, shuffle)
        assert folded.examples == 256


def test_a_client_costs_no_round_trip_of_its_own():
    ctx = make_ctx(workers=2)
    fold_round(ctx, fits(200, shards=200), state=ctx.task.init_state(0))
    # set_state and take_partial per worker, and a few batches each: not 2 per client.
    assert len(ctx.pool.log) <= 2 * (2 + BATCHES_PER_WORKER + 1), ops(ctx)


@pytest.mark.parametrize("dies_at", ["fit_batch", "take_partial"])
def test_a_worker_lost_mid_round_has_its_clients_served_again_with_the_same_bits(dies_at):
    state = make_ctx().task.init_state(0)
    reference = fold_round(make_ctx(workers=3), fits(10), state=state)
    ctx = make_ctx(workers=3, fail=lambda rank, request: "killed"
                   if rank == 2 and request["op"] == dies_at else None)
    folded = fold_round(ctx, fits(10), state=state)
    assert list(ctx.dead) == [2]
    assert list(folded.served) == list(range(10)) and folded.not_served == {}
    assert 2 not in folded.served.values()
    assert same_bytes(folded.result, reference.result), "re-served fits are the same bits"


def test_clients_no_live_worker_can_serve_are_recorded_with_the_reason():
    ctx = make_ctx(workers=2, fail=lambda rank, request: "power cut"
                   if request["op"] == "take_partial" else None)
    folded = fold_round(ctx, fits(5), state=ctx.task.init_state(0))
    assert folded.result is None and folded.served == {}
    assert sorted(folded.not_served) == [0, 1, 2, 3, 4]
    assert all("no live worker left to serve it" in why and "power cut" in why
               for why in folded.not_served.values())


def tampering(tamper: Callable[[dict[str, Any]], None]) -> type[Trainer]:
    class Hostile(Trainer):
        def handle(self, request: Any) -> dict[str, Any]:
            reply = super().handle(request)
            if request.get("op") == "take_partial" and "partial" in reply:
                tamper(reply["partial"])
            return reply
    return Hostile


def _grow(wire: dict[str, Any]) -> None:
    key = next(k for k in wire if k.startswith("f:"))
    wire[key] = np.zeros(wire[key].size + 1, np.int64)


@pytest.mark.parametrize("tamper, why", [
    (_grow, "does not match the round's model"),
    (lambda wire: wire.update(count=10 ** 9), "count = 1000000000 is out of range"),
    (lambda wire: wire.update(mass=wire["mass"] * 2), "claims"),
    (lambda wire: wire.update({k: np.full(v.shape, 2 ** 63 - 1, np.int64) for k, v in wire.items()
                               if k.startswith("f:")}), "could overflow"),
    (lambda wire: wire.update({k: v.astype(np.float64) for k, v in wire.items()
                               if k.startswith("f:")}), "int64 array"),
])
def test_a_hostile_partial_costs_its_rank_alone_and_the_bits_stay(tamper, why):
    state = make_ctx().task.init_state(0)
    reference = fold_round(make_ctx(workers=3), fits(6), state=state)
    ctx = make_ctx(workers=3)
    ranks = [1, 2, 3]
    trainers = {r: (tampering(tamper)(synthetic()) if r == 2 else Trainer(synthetic()))
                for r in ranks}
    ctx.pool = LocalPool(trainers)
    if why == "could overflow":
        # Well-formed sums at the edge of the range: merged with any other they
        # could overflow, which an honest worker's partials may do too; the sum
        # refuses it saying its range, and the round stops (never wraps around).
        with pytest.raises(AggregationError, match=why):
            fold_round(ctx, fits(6), state=state)
        return
    folded = fold_round(ctx, fits(6), state=state)
    assert list(ctx.dead) == [2] and ctx.dead[2].startswith("protocol error")
    assert why in ctx.dead[2], ctx.dead[2]
    assert list(folded.served) == list(range(6)) and 2 not in folded.served.values()
    assert same_bytes(folded.result, reference.result)


def test_a_diverged_client_is_the_rounds_aggregation_error_only_without_accept_failures():
    class Diverging:
        def __init__(self) -> None:
            self.inner = synthetic()

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def fit(self, state: Any, x: Any, y: Any, *, seed: int) -> Any:
            result = self.inner.fit(state, x, y, seed=seed)
            key = next(iter(result.state))
            result.state[key][0] = np.nan
            return result

    ctx = make_ctx(workers=2, task=Diverging)
    ctx.accept_failures = False
    with pytest.raises(AggregationError, match=r"rank \d: fit_batch: .*client \d sent NaN"):
        fold_round(ctx, fits(4), state=ctx.task.init_state(0))
    # Accepting failures (the default): each client's NaN is its own, found on two ranks.
    ctx = make_ctx(workers=3, task=Diverging)
    folded = fold_round(ctx, fits(6), state=ctx.task.init_state(0))
    assert folded.served == {} and folded.result is None and ctx.dead == {}
    assert sorted(folded.not_served) == list(range(6))
    assert all("dropped for this round" in why and "sent NaN" in why
               for why in folded.not_served.values()), folded.not_served


def test_rounds_that_need_single_contributions_play_flat():
    ctx = make_ctx()
    state = ctx.task.init_state(0)
    mean = ctx.aggregation_begin()
    plain = {c: w.request for c, w in enumerate(fits(4))}
    assert batch_applies(mean, "examples", plain, state, 2)
    assert not batch_applies(mean, "examples", plain, state, 3)  # a client a worker: no gain
    assert not batch_applies(mean, None, plain, state, 2)  # a weight a worker cannot compute
    assert not batch_applies(mean, "examples", plain, None, 2)  # replicas: no round state
    assert not batch_applies(make_ctx(aggregator="median").aggregation_begin(), "examples",
                             plain, state, 2)
    assert not batch_applies(make_ctx(aggregator="allreduce").aggregation_begin(),
                             "examples", plain, state, 2)  # must see unequal work to refuse it
    assert not batch_applies(mean, "examples", {**plain, 0: {**plain[0], "local": {}}}, state,
                             2)
    for asks_for_meanfold in (MeanFold(wide=True), MeanFold(allow_nonfinite=True)):
        assert not batch_applies(asks_for_meanfold, "examples", plain, state, 2)
    for kwargs in ({"deadline": 600.0}, {"batch": False}):
        flat = make_ctx(workers=2)
        fold_round(flat, fits(4), state=state, **kwargs)
        assert "take" in ops(flat) and "fit_batch" not in ops(flat), kwargs
    pinned = make_ctx(workers=2)
    fold_round(pinned, [Work(w.key, w.request, rank=1 + w.key % 2) for w in fits(4)],
               state=state)
    assert "fit_batch" not in ops(pinned)
    few = make_ctx(workers=3)
    fold_round(few, fits(5), state=state)
    assert "fit_batch" not in ops(few)


def test_the_coordinator_pulls_one_partial_at_a_time():
    outstanding: list[int] = []

    class Watch(LocalPool):
        def send(self, rank: int, request: Any, timeout: Any) -> int:
            ticket = super().send(rank, request, timeout)
            taking = sum(1 for q in self._queue.values() for _, r in q
                         if r["op"] == "take_partial")
            outstanding.append(taking)
            return ticket

    ctx = make_ctx(workers=4)
    ctx.pool = Watch({r: Trainer(synthetic()) for r in (1, 2, 3, 4)})
    fold_round(ctx, fits(16), state=ctx.task.init_state(0))
    assert max(outstanding) == 1
