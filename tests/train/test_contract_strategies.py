"""The built-in training strategies pass meshkit's strategy contract suite."""

from __future__ import annotations

from meshkit.simulation import Speeds
from meshkit.testing import StrategyContract

pytest_plugins = ["pytester"]


class TestLocal(StrategyContract):
    component = "local"
    options = {"rounds": 2}
    workers = 1


class TestFederated(StrategyContract):
    component = "federated"
    options = {"rounds": 2}


class TestFederatedSampledClients(StrategyContract):
    component = "federated"
    options = {"rounds": 3, "clients": 4, "fraction": 0.5, "min_clients": 1}
    workers = 3


class TestFederatedWithFedYogi(StrategyContract):
    component = "federated"
    options = {"rounds": 2}
    outer_optimizer = "fedyogi"


class TestDataParallel(StrategyContract):
    component = "data-parallel"
    options = {"rounds": 2, "steps": 2, "batch_size": 16}
    aggregator = "allreduce"


class TestFedBuffOnTheVirtualClock(StrategyContract):
    """On the clock, arrival order is simulated: any real order gives the same bits."""

    component = "fedbuff"
    options = {"rounds": 3, "clients": 4, "buffer_size": 2, "concurrency": 2}
    speeds = Speeds(seed=0, sigma=1.0)
    #: The arrived updates the clock has not reached (at most concurrency), and one folding.
    max_held = 3


class TestModelParallel(StrategyContract):
    """Inference rounds: the model stays the initial one, every round is reported."""

    component = "model-parallel"
    options = {"rounds": 2, "batch_size": 256,
               "partitions": [{"nodes": ["scale", "hidden"], "rank": 1},
                              {"nodes": ["output"], "rank": 2}]}


BROKEN = '''
from meshkit.testing import StrategyContract

pytest_plugins = ["pytester"]
from meshkit.train import RoundOutcome, client_seed, run_rounds


class CollectAll:
    """The pre-engine way: every client's whole model collected, then folded."""

    def run(self, ctx):
        return run_rounds(ctx, "collect-all", 2, ctx.initial_state(), self.play_round)

    def play_round(self, ctx, rnd, state):
        live = ctx.live
        replies = ctx.call([(r, {"op": "fit", "state": state, "shard": i,
                                 "shards": len(live), "seed": client_seed(0, rnd, i)})
                            for i, r in enumerate(live)])
        fold = ctx.aggregation_begin()
        for reply in replies:
            fold.add(reply.payload["state"], reply.payload["examples"])
        state = fold.result()
        return RoundOutcome(state, answered=tuple(r.rank for r in replies))


class ArrivalOrder(CollectAll):
    """Folds each client as its answer arrives: the sums depend on who was first."""

    def play_round(self, ctx, rnd, state):
        live = ctx.live
        for i, r in enumerate(live):
            ctx.pool.send(r, {"op": "fit", "state": state, "shard": i, "shards": len(live),
                              "seed": client_seed(0, rnd, i)}, None)
        fold = ctx.aggregation_begin()
        answered = []
        for _ in live:
            reply = ctx.pool.receive()
            fold.add(reply.payload["state"], reply.payload["examples"])
            answered.append(reply.rank)
        return RoundOutcome(fold.result(), answered=tuple(sorted(answered)))


class TestCollectAll(StrategyContract):
    workers = 4

    def make(self):
        return CollectAll()


class TestArrivalOrder(StrategyContract):
    workers = 4
    task = "synthetic"
    task_options = {"params": 64, "rows": 64}

    def make(self):
        return ArrivalOrder()
'''


def test_the_strategy_contract_catches_collecting_every_reply_and_arrival_order(pytester):
    pytester.makepyfile(test_broken_strategies=BROKEN)
    result = pytester.runpytest_inprocess("-p", "no:randomly", "-p", "no:cacheprovider",
                                          "--tb=line", "-q")
    failed = {r.nodeid.split("::", 1)[1]
              for r in result.reprec.getreports("pytest_runtest_logreport")
              if r.when == "call" and r.failed}
    text = result.stdout.str()
    assert "TestCollectAll::test_the_coordinator_holds_a_bounded_number_of_contributions" \
        in failed
    assert "with 8 workers the coordinator held 8 whole states at once" in text
    assert "TestArrivalOrder::test_the_order_answers_arrive_in_does_not_change_the_model" \
        in failed
    assert "fold contributions in client order, not arrival order" in text
    # What each does right still passes.
    assert "TestCollectAll::test_the_order_answers_arrive_in_does_not_change_the_model" \
        not in failed
    assert "TestArrivalOrder::test_the_same_seed_gives_the_same_model" not in failed
