"""The round engine in-process: fold order, the window, lost workers' work served again.

Most tests here play the flat (per-client) engine (``batch=False``);
tests/train/rounds/test_batched.py has the batched round's.
"""

from __future__ import annotations

import numpy as np
import pytest

import meshkit.plugins
from meshkit.errors import MeshError
from meshkit.train import HOLD, LocalPool, Work, client_seed, fold_round
from meshkit.train._messages import signature
from meshkit.train._rounds.flat import result_bytes
from meshkit.train._rounds.work import INLINE_BYTES
from meshkit.train._worker.trainer import Trainer

from tests.support.rounds import fits, make_ctx, same_bytes, synthetic

# -- determinism -----------------------------------------------------------------


def test_shuffled_arrival_orders_give_a_bit_identical_model():
    ctx = make_ctx()
    state = ctx.task.init_state(0)
    reference = fold_round(ctx, fits(12), state=state, batch=False)
    for shuffle in range(1, 6):
        ctx = make_ctx(order=np.random.default_rng(shuffle))
        again = fold_round(ctx, fits(12), state=state, batch=False)
        assert same_bytes(again.result, reference.result), f"shuffle {shuffle}"
        assert list(again.served) == list(range(12)), "folded in client order"
    # The test can fail: the same contributions folded in another order differ.
    contributions = [ctx.task.fit(state, *ctx.task.train_data(), seed=s).state
                     for s in range(12)]
    folds = []
    for order in (range(12), reversed(range(12))):
        fold = ctx.aggregation_begin()
        for i in order:
            fold.add(contributions[i], float(i + 1))
        folds.append(fold.result())
    assert not same_bytes(folds[0], folds[1]), "synthetic contributions are order-sensitive"


def test_a_whole_federated_run_is_bit_identical_whatever_order_answers_arrive_in():
    def run(order):
        ctx = make_ctx(workers=3, order=order)
        return meshkit.plugins.create("strategy", "federated",
                                      {"rounds": 3, "clients": 7, "window": 2}).run(ctx)

    reference = run(None).state
    for shuffle in (11, 12, 13):
        assert same_bytes(run(np.random.default_rng(shuffle)).state, reference)


def test_the_result_is_the_aggregators_fold_in_client_order():
    ctx = make_ctx(workers=3, order=np.random.default_rng(4))
    state = ctx.task.init_state(0)
    folded = fold_round(ctx, fits(5), state=state, batch=False)
    fold = ctx.aggregation_begin()
    x, y = ctx.task.train_data()
    for c in range(5):
        lo, hi = c * 51, (256 if c == 4 else (c + 1) * 51)
        result = ctx.task.fit(state, x[lo:hi], y[lo:hi], seed=client_seed(7, 1, c))
        fold.add(result.state, float(result.examples))
    assert same_bytes(folded.result, fold.result())
    assert folded.examples == 256


# -- what the coordinator holds ------------------------------------------------------


@pytest.mark.parametrize("window", [1, 2, 3])
@pytest.mark.parametrize("small", [0, 2])
def test_the_coordinator_holds_a_window_of_contributions_whatever_the_client_count(window, small):
    # ``small``: how many of the model's results fit in INLINE_BYTES (0: a large model).
    for clients in (4, 16):
        ctx = make_ctx(workers=8, order=np.random.default_rng(clients))
        state = ctx.task.init_state(0)
        ctx.inline_bytes = small * result_bytes(signature(state))
        fold_round(ctx, fits(clients), state=state, window=window, batch=False)
        # The window, the small results beyond it, and the one the fold retains.
        assert ctx.pool.peak_held <= window + small + 1, (clients, ctx.pool.peak_held)


def _carries_state(request):
    return request["op"] == "fit" and request.get("set_state") is True and "state" in request


def test_the_state_goes_once_to_each_worker_the_round_needs_with_its_first_fit():
    ctx = make_ctx(workers=4)
    state = ctx.task.init_state(0)
    fold_round(ctx, fits(8), state=state, batch=False)
    assert not any(req["op"] == "set_state" for _, req in ctx.pool.log)
    carried = [(r, req) for r, req in ctx.pool.log if "state" in req]
    assert sorted(r for r, _ in carried) == [1, 2, 3, 4]  # once each
    assert all(_carries_state(req) for _, req in carried)
    # ... and it is each worker's first request of the round.
    firsts = {}
    for rank, req in ctx.pool.log:
        firsts.setdefault(rank, req)
    assert all(_carries_state(req) for req in firsts.values())
    assert all(req["state"] is state for _, req in carried), "the round's state, not a copy"
    few = make_ctx(workers=4)
    fold_round(few, fits(2), state=few.task.init_state(0), batch=False)
    assert sorted(r for r, req in few.pool.log if "state" in req) == [1, 2]


def test_a_small_models_results_come_back_with_their_fits():
    # The synthetic model (16 KiB) is far under INLINE_BYTES: at the default window a
    # 3-on-3 round is turn 2's 3 requests, each fit carrying the state and its result.
    ctx = make_ctx(workers=3, inline_bytes=None)
    state = ctx.task.init_state(0)
    assert result_bytes(signature(state)) * 3 < INLINE_BYTES
    folded = fold_round(ctx, fits(3), state=state, batch=False)
    log = [req for _, req in ctx.pool.log]
    assert [req["op"] for req in log] == ["fit"] * 3, log
    assert all(_carries_state(req) and "keep" not in req for req in log)
    # As many as fit in the budget come back with their fit; the rest wait to be taken.
    size = result_bytes(signature(state))
    for budget, takes in ((2 * size, 0), (size, 1), (size - 1, 2)):
        held = make_ctx(workers=3, inline_bytes=budget)
        again = fold_round(held, fits(3), state=state, batch=False)
        log = [req for _, req in held.pool.log]
        assert sorted(req["op"] for req in log) == ["fit"] * 3 + ["take"] * takes, budget
        assert [req.get("keep") for req in log if req["op"] == "fit"] == \
            [None] * (3 - takes) + list(range(3 - takes, 3)), budget
        assert same_bytes(folded.result, again.result), "the same fold, in the same order"


def test_the_key_the_fold_waits_on_comes_back_with_its_answer():
    # Within the pull window a fit's result is not held on its worker: no keep, no take;
    # the state goes with each worker's fit: 3 clients on 3 workers are 3 requests.
    # (make_ctx: no result comes back inline for being small, as for a large model.)
    ctx = make_ctx(workers=3)
    state = ctx.task.init_state(0)
    folded = fold_round(ctx, fits(3), state=state, window=3, batch=False)
    ops = [req["op"] for _, req in ctx.pool.log]
    assert ops == ["fit"] * 3, ops
    assert all(_carries_state(req) for _, req in ctx.pool.log)
    assert all("keep" not in req for _, req in ctx.pool.log)
    # Beyond the window a result waits on its worker and is pulled in its turn: 5 requests.
    held = make_ctx(workers=3)
    again = fold_round(held, fits(3), state=state, window=1, batch=False)
    log = [req for _, req in held.pool.log]
    assert sorted(req["op"] for req in log) == ["fit"] * 3 + ["take"] * 2
    assert [req.get("keep") for req in log if req["op"] == "fit"] == [None, 1, 2]
    assert sorted(req["key"] for req in log if req["op"] == "take") == [1, 2]
    assert same_bytes(folded.result, again.result), "the same fold, in the same order"
    # The same bits as the state sent on its own first (set_state, then fits without it).
    alone = make_ctx(workers=3)
    for rank in (1, 2, 3):
        assert "error" not in alone.pool.trainers[rank].handle(
            {"op": "set_state", "state": state})
    fold = alone.aggregation_begin()
    for work in fits(3):
        reply = alone.pool.trainers[1 + work.key].handle(dict(work.request))
        fold.add(reply["state"], float(reply["examples"]))
    assert same_bytes(fold.result(), folded.result)


def test_a_worker_keeps_at_most_hold_results_waiting():
    held = []

    class Watch(LocalPool):
        def receive(self, block=True):
            reply = super().receive(block)
            held.append(max(len(t.kept) for t in self.trainers.values()))
            return reply

    ranks = [1, 2]
    ctx = make_ctx(workers=2)
    ctx.pool = Watch({r: ctx.pool.trainers[r] for r in ranks})
    fold_round(ctx, fits(10), state=ctx.task.init_state(0), batch=False)
    assert max(held) <= HOLD


def test_a_new_round_discards_what_the_last_one_left_on_a_worker():
    ctx = make_ctx(workers=1)
    trainer = ctx.pool.trainers[1]
    state = ctx.task.init_state(0)
    trainer.handle({"op": "set_state", "state": state})
    trainer.handle({"op": "fit", "shard": 0, "shards": 2, "seed": 1, "keep": 0})
    assert list(trainer.kept) == [0]
    trainer.handle({"op": "set_state", "state": state})
    assert trainer.kept == {}
    reply = trainer.handle({"op": "take", "key": 0})
    assert "no result 0 is kept here" in reply["error"]


# -- lost workers --------------------------------------------------------------------


def test_a_worker_lost_mid_round_has_its_clients_served_again_with_the_same_bits():
    ctx = make_ctx(workers=4)
    state = ctx.task.init_state(0)
    reference = fold_round(ctx, fits(8), state=state, batch=False)

    def fail(rank, request):
        # Rank 2 dies after computing its first fit, before it is taken.
        return "killed" if rank == 2 and request["op"] == "take" else None

    ctx = make_ctx(workers=4, fail=fail)
    folded = fold_round(ctx, fits(8), state=state, batch=False)
    assert list(ctx.dead) == [2]
    assert list(folded.served) == list(range(8)) and folded.not_served == {}
    assert 2 not in folded.served.values()
    assert same_bytes(folded.result, reference.result), "re-served fits are the same bits"


def test_a_worker_lost_on_the_fit_that_carried_the_state_has_its_client_served_again():
    ctx = make_ctx(workers=3, fail=lambda rank, request: "gone" if rank == 3 else None)
    state = ctx.task.init_state(0)
    folded = fold_round(ctx, fits(3), state=state)
    to_3 = [req for rank, req in ctx.pool.log if rank == 3]
    assert len(to_3) == 1 and _carries_state(to_3[0]) and to_3[0]["shard"] == 2
    assert list(folded.served) == [0, 1, 2] and set(folded.served.values()) == {1, 2}
    assert list(ctx.dead) == [3] and folded.not_served == {}
    assert same_bytes(folded.result, fold_round(make_ctx(workers=3), fits(3),
                                                state=state).result)


def test_a_lost_worker_is_replaced_by_one_that_had_no_work_this_round():
    ctx = make_ctx(workers=4, fail=lambda rank, request: "gone" if rank == 1 else None)
    folded = fold_round(ctx, fits(3), state=ctx.task.init_state(0), batch=False)
    # Three clients: ranks 1-3 were sent the state with their first fit; rank 4 stood in
    # for rank 1, its state with its first fit too, at once.
    assert sorted(r for r, req in ctx.pool.log if _carries_state(req)) == [1, 2, 3, 4]
    assert not any(req["op"] == "set_state" for _, req in ctx.pool.log)
    assert set(folded.served.values()) == {2, 3, 4}
    assert folded.served[0] == 4, "rank 1's client, served by the rank that stood in"


def test_an_error_reply_to_the_fit_that_carried_the_state_sends_it_again():
    # The only worker refuses its first fit as a worker refuses a request that does not
    # fit its schema: before it holds the state. With one live worker that is the client's
    # failure; the next client's fit must carry the state again, or it would start from
    # the model the worker held before (an earlier round's).
    state = make_ctx().task.init_state(0)

    class RefusesFirst(Trainer):
        refused = 0

        def handle(self, request):
            if request.get("set_state") and not self.refused:
                self.refused += 1
                return {"error": "protocol error: refused", "seq": request.get("seq", 0)}
            return super().handle(request)

    ctx = make_ctx(workers=1)
    trainer = RefusesFirst(ctx.task)
    trainer.handle({"op": "set_state", "state": make_ctx().task.init_state(5)})  # stale
    ctx.pool.trainers[1] = trainer
    folded = fold_round(ctx, fits(2), state=state, batch=False)
    assert trainer.refused == 1 and list(folded.not_served) == [0] and list(folded.served) == [1]
    sent = [req for _, req in ctx.pool.log if req["op"] == "fit"]
    assert [_carries_state(req) for req in sent] == [True, True]
    expected = ctx.aggregation_begin()
    fresh = Trainer(ctx.task)
    fresh.handle({"op": "set_state", "state": state})
    reply = fresh.handle(dict(fits(2)[1].request))
    expected.add(reply["state"], float(reply["examples"]))
    assert same_bytes(folded.result, expected.result())


def test_clients_no_live_worker_can_serve_are_recorded_with_the_reason():
    lost = set()

    def fail(rank, request):
        # Asked to fit (a key the fold waits on comes back at once) or to hand over
        # (a kept one) client 2 or later.
        if request["op"] in ("fit", "take") and request.get("key", request.get("shard")) >= 2:
            lost.add(rank)
        return "power cut" if rank in lost else None

    ctx = make_ctx(workers=2, fail=fail)
    folded = fold_round(ctx, fits(5), state=ctx.task.init_state(0), batch=False)
    assert list(folded.served) == [0, 1]
    assert sorted(folded.not_served) == [2, 3, 4]
    assert all("no live worker left to serve it" in why and "power cut" in why
               for why in folded.not_served.values())
    assert folded.result is not None, "what was served is still folded"


def test_with_no_live_worker_nothing_is_served_and_no_result_is_invented():
    ctx = make_ctx(workers=2, fail=lambda rank, request: "gone")
    folded = fold_round(ctx, fits(3), state=ctx.task.init_state(0))
    assert folded.result is None and folded.served == {} and sorted(folded.not_served) == [0, 1, 2]


class Broken:
    """synthetic, but the fit of shard 3 raises (as a user's bug on one client's data would)."""

    def __init__(self):
        self.inner = synthetic()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def fit(self, state, x, y, *, seed):
        if seed == client_seed(7, 1, 3):
            raise ValueError("bad shard")
        return self.inner.fit(state, x, y, seed=seed)


def test_without_accept_failures_a_task_error_stops_the_round_with_the_workers_message():
    for batch in (False, True):
        ctx = make_ctx(workers=2, task=Broken)
        ctx.accept_failures = False
        with pytest.raises(MeshError, match=r"rank \d: fit: ValueError: bad shard"):
            fold_round(ctx, fits(8), state=ctx.task.init_state(0), batch=batch)


@pytest.mark.parametrize("batch", [False, True])
def test_a_client_failing_on_two_ranks_is_its_own_failure_and_is_not_served_on_every_worker(
        batch):
    ctx = make_ctx(workers=4, task=Broken)
    state = ctx.task.init_state(0)
    folded = fold_round(ctx, fits(8), state=state, batch=batch)
    assert list(folded.not_served) == [3]
    why = folded.not_served[3]
    assert why.startswith("failed on 2 ranks, so the failure is its own") and "bad shard" in why
    assert sorted(folded.served) == [0, 1, 2, 4, 5, 6, 7]
    assert ctx.dead == {} and folded.failed == {}  # the client's failure: no rank is blamed
    honest = make_ctx(workers=3)  # 7 clients on 3 workers: batched too (2 a worker or more)
    expected = fold_round(honest, [w for w in fits(8) if w.key != 3], state=state, batch=batch)
    assert same_bytes(folded.result, expected.result)
def test_work_needs_distinct_keys_and_a_positive_window():
    ctx = make_ctx(workers=1)
    with pytest.raises(ValueError, match="its own key"):
        fold_round(ctx, [Work(0, {}), Work(0, {})])
    with pytest.raises(ValueError, match="window must be at least 1"):
        fold_round(ctx, fits(1), window=0)


# -- data-parallel -------------------------------------------------------------------


def test_a_dead_replicas_shard_is_recomputed_by_a_live_one_so_the_step_mean_is_unchanged():
    def run(fail):
        ctx = make_ctx(workers=3, fail=fail, aggregator="allreduce")
        ctx.call([(r, {"op": "set_state", "state": ctx.task.init_state(0)}) for r in ctx.live])
        work = [Work(i, {"op": "grads", "shard": i, "shards": 3, "batch_size": 0,
                         "seed": client_seed(0, 0, i)}) for i in range(3)]
        return ctx, fold_round(ctx, work, weight=lambda reply: 1.0, label="shard")

    _, whole = run(None)
    ctx, survived = run(lambda rank, request: "gone" if rank == 3 and
                        request["op"] == "grads" else None)
    assert list(ctx.dead) == [3] and list(survived.served) == [0, 1, 2]
    assert survived.served[2] in (1, 2)
    assert same_bytes(survived.result, whole.result)
