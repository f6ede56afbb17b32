"""The built-in strategies' semantics, each with a test (driven in-process through LocalPool)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import meshkit
import meshkit.plugins
from meshkit.errors import ConfigError, MeshError, PeerLostError, PlacementError
from meshkit.task import FitResult
from meshkit.train import LocalPool, Partition, Reply, StrategyContext, Trainer, WorkerIdentity


class ShardMean:
    """A task whose 'model' is the mean of the shard it was fit on.

    A run that quietly used one client cannot produce the mean of two.
    """

    def __init__(self, rows: int = 8) -> None:
        self.x = np.arange(rows, dtype=np.float64).reshape(rows, 1)
        self.y = np.arange(rows, dtype=np.float64) * 10

    def init_state(self, seed: int) -> dict:
        return {"m": np.zeros(1)}

    def train_data(self):
        return self.x, self.y

    def fit(self, state, x, y, *, seed):
        return FitResult({"m": np.array([x.mean()])}, len(x), {"train_loss": 0.0})

    def evaluate(self, state):
        return {"m": float(np.asarray(state["m"])[0])}

    # data-parallel: gradient 1 everywhere, apply subtracts it.
    def gradients(self, state, x, y):
        return FitResult({"m": np.ones(1)}, len(x), {})

    def apply(self, state, gradients):
        return {"m": np.asarray(state["m"]) - np.asarray(gradients["m"])}

    # model-parallel: each stage adds one, so the output identifies the stage.
    def stages(self):
        return ("a", "b")

    def run_stage(self, state, node, x):
        return np.asarray(x) + 1.0

    def test_data(self):
        return np.array([[10.0, 0.0]]), np.array([0])


FITS = ("fit", "fit_batch")  # a client's fit, alone or in a batch (the batched round)


def fitted(request) -> list[tuple[int, int]]:
    """(shard, seed) of every fit a request asks for (none for other ops)."""
    if request.get("op") == "fit":
        return [(request["shard"], request["seed"])]
    if request.get("op") == "fit_batch":
        return [(fit["shard"], fit["seed"]) for fit in request["fits"]]
    return []


def make_ctx(task, ranks=(1, 2), fail=None, **kw) -> StrategyContext:
    pool = LocalPool.of(lambda: task, ranks, fail=fail)
    defaults = dict(
        task=task,
        aggregator=meshkit.plugins.create("aggregator", "fedavg"),
        pool=pool,
        workers=list(ranks),
        rng=np.random.default_rng(0),
        outer=meshkit.plugins.create("outer_optimizer", "average"),
    )
    defaults.update(kw)
    return StrategyContext(**defaults)


def strategy(name, **options):
    return meshkit.plugins.create("strategy", name, options)


# -- federated -----------------------------------------------------------------


def test_the_federated_loop_converges_to_the_mean_of_its_clients():
    # 0..7 split in two: client means 1.5 and 5.5, whose mean is 3.5.
    ctx = make_ctx(ShardMean(8))
    result = strategy("federated", rounds=2).run(ctx)
    m = float(result.state["m"][0])
    assert m == pytest.approx(3.5)
    # Not either client alone: a single-client path cannot pass this.
    assert abs(m - 1.5) > 1e-6 and abs(m - 5.5) > 1e-6


def test_federated_reports_every_round_with_who_answered():
    reports = []
    ctx = make_ctx(ShardMean(8), on_round=lambda report, state: reports.append(report))
    strategy("federated", rounds=3).run(ctx)
    assert [r.round for r in reports] == [1, 2, 3]
    assert all(r.answered == (1, 2) and r.clients == (0, 1) for r in reports)
    assert reports[-1].metrics["m"] == pytest.approx(3.5)


class AdmitsLater(LocalPool):
    """A pool where rank 3 is live only once admitted (a worker that joined after round 1)."""

    admitted = False

    def live(self, ranks):
        return [r for r in super().live(ranks) if r != 3 or self.admitted]


def test_a_worker_joining_a_federated_run_is_sent_the_model_once():
    task = ShardMean(9)
    pool = AdmitsLater.of(lambda: task, (1, 2, 3))

    def admit():
        if pool.admitted or not reports:
            return ()
        pool.admitted = True
        return (3,)

    reports = []
    ctx = make_ctx(task, ranks=(1, 2, 3), pool=pool, admit=admit,
                   on_round=lambda report, state: reports.append(report))
    result = strategy("federated", rounds=2, clients=3).run(ctx)
    assert [r.joined for r in reports] == [(), (3,)] and reports[1].served[2] == 3
    # The round's own fit carries it: no set_state before the round besides (and, the
    # model being small, its result comes back with the fit: no take).
    to_3 = [req for rank, req in pool.log if rank == 3]
    assert [(req["op"], "state" in req) for req in to_3] == [("fit", True)]
    assert float(result.state["m"][0]) == pytest.approx(4.0)  # the mean of 0..8


def test_poisson_sampling_asks_each_round_the_cohort_of_seed_and_round():
    from meshkit.train import poisson_clients

    reports = []
    ctx = make_ctx(ShardMean(40), seed=9, on_round=lambda report, state: reports.append(report))
    strategy("federated", rounds=6, clients=20, fraction=0.2, sampling="poisson").run(ctx)
    cohorts = [poisson_clients(9, r, 20, 0.2) for r in range(1, 7)]
    assert [list(r.clients) for r in reports] == cohorts
    assert len({len(c) for c in cohorts}) > 1  # the size varies: not a fixed-size draw


def test_a_worker_lost_mid_round_is_dropped_and_its_client_served_by_a_survivor():
    lost = threading.Event()

    def fail(rank, request):
        if rank == 2 and request.get("op") in FITS and (
                lost.is_set() or any(seed for _, seed in fitted(request))):
            lost.set()
            return "connection reset"
        return None

    reports = []
    ctx = make_ctx(ShardMean(8), ranks=(1, 2, 3), fail=fail,
                   on_round=lambda report, state: reports.append(report))
    result = strategy("federated", rounds=2, min_clients=3).run(ctx)
    assert reports[0].answered == (1, 3) and reports[0].dropped == (2,)
    assert list(ctx.dead) == [2] and ctx.dead[2] == "connection reset"
    # Every client was served: rank 2's client 1 by a survivor, in the same round.
    assert reports[0].clients == (0, 1, 2) and reports[0].not_served == {}
    assert reports[0].served[1] in (1, 3)
    # Round 2 goes to the survivors only, and still folds all three clients.
    assert reports[1].answered == (1, 3) and reports[1].dropped == ()
    assert all(rank != 2 for rank, req in ctx.pool.log[len(ctx.pool.log) // 2:])
    # Shards (0, 1), (2, 3), (4..7): means 0.5, 2.5, 5.5 weighted 2, 2, 4 -- every row.
    assert float(result.state["m"][0]) == pytest.approx(3.5)


def test_one_survivor_serves_every_client_so_min_clients_still_holds():
    ctx = make_ctx(ShardMean(8), ranks=(1, 2),
                   fail=lambda rank, request: "gone" if rank == 2 else None)
    result = strategy("federated", rounds=2, min_clients=2).run(ctx)
    assert float(result.state["m"][0]) == pytest.approx(3.5)


def test_clients_no_live_worker_can_serve_stop_the_run_saying_which_and_why():
    ctx = make_ctx(ShardMean(8), ranks=(1, 2),
                   fail=lambda rank, request: "gone" if request["op"] in FITS else None)
    with pytest.raises(MeshError) as err:
        strategy("federated", rounds=3, min_clients=2).run(ctx)
    message = str(err.value)
    assert "0 of 2 clients served, fewer than min_clients = 2" in message
    assert "client 0: no live worker left to serve it" in message
    assert "rank 1: gone" in message and "--resume" in message


def test_more_clients_than_workers_spreads_clients_over_workers():
    ctx = make_ctx(ShardMean(8), ranks=(1, 2))
    result = strategy("federated", rounds=1, clients=4).run(ctx)
    # Shards of 2 rows: means 0.5, 2.5, 4.5, 6.5 -> 3.5.
    assert float(result.state["m"][0]) == pytest.approx(3.5)
    fits = {(rank, shard) for rank, req in ctx.pool.log for shard, _ in fitted(req)}
    # Batched (two clients a worker): each worker its contiguous batch.
    assert fits == {(1, 0), (1, 1), (2, 2), (2, 3)}, "planned in batches, in client order"


def test_min_clients_above_the_client_count_is_a_config_error():
    with pytest.raises(ConfigError, match="min_clients = 5 but there are only 2 clients"):
        strategy("federated", min_clients=5).run(make_ctx(ShardMean(8)))


def test_min_clients_counts_answers_so_two_workers_can_serve_three_of_four_clients():
    ctx = make_ctx(ShardMean(8), ranks=(1, 2))
    strategy = meshkit.plugins.create("strategy", "federated",
                                      {"rounds": 1, "clients": 4, "min_clients": 3})
    result = strategy.run(ctx)
    assert float(result.state["m"][0]) == pytest.approx(3.5)


def test_more_federated_clients_than_training_rows_is_refused_before_the_run():
    strategy = meshkit.plugins.create("strategy", "federated", {"clients": 9})
    with pytest.raises(ConfigError, match="clients = 9 but the task has only 8 training rows"):
        strategy.check(task=ShardMean(8), outer_name="average", workers=2)


# -- local ---------------------------------------------------------------------


def test_local_fits_the_whole_training_set_on_one_worker():
    ctx = make_ctx(ShardMean(8))
    result = strategy("local", rounds=1).run(ctx)
    assert float(result.state["m"][0]) == pytest.approx(3.5)
    assert {rank for rank, _ in ctx.pool.log} == {1}


class PlusHundred:
    """An outer optimizer whose step is unmistakable."""

    def step(self, global_state, consensus):
        return {k: np.asarray(v) + 100.0 for k, v in consensus.items()}

    def state_dict(self):
        return {}

    def load_state_dict(self, d):
        pass


def test_the_local_strategy_steps_the_outer_optimizer_as_documented():
    ctx = make_ctx(ShardMean(8), ranks=(1,), outer=PlusHundred())
    result = meshkit.plugins.create("strategy", "local", {"rounds": 1}).run(ctx)
    assert float(result.state["m"][0]) == pytest.approx(3.5 + 100.0)


# -- data-parallel -------------------------------------------------------------


def test_data_parallel_returns_the_state_after_the_step():
    ctx = make_ctx(ShardMean(8), aggregator=meshkit.plugins.create("aggregator", "allreduce"))
    result = strategy("data-parallel", rounds=1, steps=3).run(ctx)
    # Three steps of "subtract the averaged gradient (1)": -3, not the
    # pre-step 0 a remembered state would give.
    assert float(result.state["m"][0]) == pytest.approx(-3.0)
    ops = [req["op"] for _, req in ctx.pool.log]
    assert ops[-1] == "get_state", "the state is read back after the step"
    assert ops.count("apply") == 6, "every replica applies every step"


def test_data_parallel_steps_the_outer_optimizer_once_a_round_and_resets_the_replicas():
    # fedavgm without momentum at lr 0.5: x <- x - 0.5 (x - replicas). Each
    # round's two inner steps take the replicas 2 below the round's start.
    outer = meshkit.plugins.create("outer_optimizer", "fedavgm", {"lr": 0.5, "momentum": 0.0})
    ctx = make_ctx(ShardMean(8), aggregator=meshkit.plugins.create("aggregator", "allreduce"),
                   outer=outer, outer_name="fedavgm")
    result = strategy("data-parallel", rounds=2, steps=2).run(ctx)
    # Round 1: 0 -> replicas -2 -> x = -1; round 2: -1 -> replicas -3 -> x = -2.
    assert float(result.state["m"][0]) == pytest.approx(-2.0)
    sets = [req for _, req in ctx.pool.log if req["op"] == "set_state"]
    assert [float(r["state"]["m"][0]) for r in sets] == [0.0, 0.0, -1.0, -1.0, -2.0, -2.0]


class JoinsLate(LocalPool):
    """A pool where rank 3 becomes live only once ``after`` requests were sent (a worker
    whose link came up after the run's first ``set_state``, as a torchdist coordinator
    that does not wait for its workers sees it); ``peer_reduce``: the workers all-reduce
    among themselves (the mesh path's ``step``)."""

    after = 0
    peer_reduce = False

    def live(self, ranks):
        return [r for r in super().live(ranks) if r != 3 or len(self.log) >= self.after]


class EchoGroup:
    """A worker's group whose all-reduce returns the worker's own gradients: ShardMean's
    gradients are 1 on every replica, so that is their mean."""

    def mesh_all_reduce(self, state, weight=1.0, *, ranks=None, timeout=None):
        return dict(state)


def late_joiner_ctx(after: int, *, mesh: bool) -> StrategyContext:
    task = ShardMean(8)
    pool = JoinsLate({r: Trainer(task, group=EchoGroup()) for r in (1, 2, 3)})
    pool.after, pool.peer_reduce = after, mesh
    return make_ctx(task, ranks=(1, 2, 3), pool=pool,
                    aggregator=meshkit.plugins.create("aggregator", "allreduce"))


#: When rank 3 turns live: after the start's set_state to ranks 1 and 2 (2
#: requests), or mid-round once step 1 went to them (star: 2 set_state, 2
#: grads, 2 apply; mesh: 2 set_state, 2 step).
LATE = {("start", False): 2, ("start", True): 2, ("mid-round", False): 6,
        ("mid-round", True): 4}


@pytest.mark.parametrize("mesh", [False, True], ids=["star", "mesh"])
@pytest.mark.parametrize("when", ["start", "mid-round"])
def test_a_data_parallel_replica_that_never_got_the_model_is_given_it_before_a_step(
        when, mesh):
    ctx = late_joiner_ctx(LATE[when, mesh], mesh=mesh)
    result = strategy("data-parallel", rounds=2, steps=2).run(ctx)
    assert float(result.state["m"][0]) == pytest.approx(-4.0), "every step happened once"
    to_3 = [req["op"] for rank, req in ctx.pool.log if rank == 3]
    assert to_3[0] == "set_state", f"rank 3 was sent {to_3[0]!r} before any model"
    if when == "mid-round":
        # Mid-round, the replicas' model is read back and handed over, not the round's start.
        assert float(next(req["state"]["m"][0] for rank, req in ctx.pool.log
                          if rank == 3)) == pytest.approx(-1.0)


class WrongModel(Trainer):
    """A replica whose model, read back, has the wrong shape."""

    def handle(self, request):
        reply = super().handle(request)
        return {**reply, "state": {"m": np.zeros(2)}} if request["op"] == "get_state" else reply


def test_a_replica_whose_model_does_not_fit_is_not_the_one_a_late_rank_is_handed():
    ctx = late_joiner_ctx(LATE["mid-round", False], mesh=False)
    ctx.pool.trainers[1] = WrongModel(ctx.task, group=EchoGroup())
    strategy("data-parallel", rounds=1, steps=2).run(ctx)
    assert "protocol error" in ctx.dead[1]
    handed = [req["state"]["m"] for rank, req in ctx.pool.log
              if rank == 3 and req["op"] == "set_state"]
    assert handed and np.array_equal(handed[0], [-1.0]), "rank 2's model, after step 1"


class LosesAnAck(LocalPool):
    """A pool whose reply to rank 3's set_state is lost without its ledger declaring rank 3
    dead (a host relay's ``fanout`` answer without it: the relay's news comes later)."""

    def receive(self, block=True, until=None):
        ranks = sorted((q[0][0], r) for r, q in self._queue.items() if q)
        rank = ranks[0][1] if ranks else None
        if rank == 3 and self._queue[3][0][1]["op"] == "set_state":
            seq, _ = self._queue[3].popleft()
            return Reply(3, None, "host relay 'relay-1' did not answer for rank 3", seq)
        return super().receive(block, until)


def test_a_data_parallel_replica_that_did_not_acknowledge_the_model_is_not_sent_a_step():
    task = ShardMean(8)
    ctx = make_ctx(task, ranks=(1, 2, 3), pool=LosesAnAck.of(lambda: task, (1, 2, 3)),
                   aggregator=meshkit.plugins.create("aggregator", "allreduce"))
    result = strategy("data-parallel", rounds=1, steps=2, min_workers=2).run(ctx)
    assert float(result.state["m"][0]) == pytest.approx(-2.0)
    assert [req["op"] for rank, req in ctx.pool.log if rank == 3] == ["set_state"]
    assert "did not acknowledge" in ctx.dead[3] and "rank 3" in ctx.dead[3]


def test_more_data_parallel_workers_than_training_rows_is_refused_before_the_run():
    strategy = meshkit.plugins.create("strategy", "data-parallel", {})
    with pytest.raises(ConfigError, match="3 training rows over 4 workers"):
        strategy.check(task=ShardMean(3), outer_name="average", workers=4)


class NoApply(ShardMean):
    apply = None  # type: ignore[assignment]


@pytest.mark.parametrize("name", ["data-parallel", "diloco"])
def test_a_replica_strategy_refuses_a_task_without_apply_or_with_too_few_rows(name):
    # One check for both replica strategies (meshkit_strategies._shared.require_replica_task).
    strategy = meshkit.plugins.create("strategy", name, {})
    with pytest.raises(ConfigError, match=rf"{name} needs the task to offer apply\(\)"):
        strategy.check(task=NoApply(8), outer_name="nesterov", workers=2)
    with pytest.raises(ConfigError, match=rf"{name} shards the task's 3 training rows over 4 "
                                          rf"workers.*Use at most 3 workers"):
        strategy.check(task=ShardMean(3), outer_name="nesterov", workers=4)


def test_data_parallel_min_workers_above_the_worker_count_is_refused_before_the_run():
    strategy = meshkit.plugins.create("strategy", "data-parallel", {"min_workers": 3})
    with pytest.raises(ConfigError, match="min_workers = 3 but there are only 2 workers"):
        strategy.check(task=ShardMean(8), outer_name="average", workers=2)


# -- model-parallel ------------------------------------------------------------


def test_model_parallel_threads_the_activation_between_stages():
    ctx = make_ctx(ShardMean(8), identities=[WorkerIdentity(1, ("gpu0",)),
                                             WorkerIdentity(2, ("gpu1",))])
    strat = strategy("model-parallel",
                     partitions=[{"nodes": ["b"], "tag": "gpu1"}, {"nodes": ["a"], "tag": "gpu0"}])
    result = strat.run(ctx)
    seen = [(rank, req["nodes"], np.asarray(req["x"]).tolist())
            for rank, req in ctx.pool.log if req["op"] == "stage"]
    assert seen[0] == (1, ["a"], [[10.0, 0.0]]), "stage 1 on gpu0 gets the input"
    # Stage 2 receives stage 1's output, not the graph input.
    assert seen[1] == (2, ["b"], [[11.0, 1.0]])
    assert result.metrics["accuracy"] == 1.0  # argmax of [12, 2] is class 0


def test_a_partition_pinned_to_an_unknown_tag_is_refused_naming_the_registered_workers():
    ctx = make_ctx(ShardMean(8), identities=[WorkerIdentity(1, ("cpu",))])
    with pytest.raises(PlacementError) as err:
        ctx.worker_for(Partition(("a",), tag="gpu"))
    assert "no live worker answers to tag 'gpu'" in str(err.value)
    assert "rank 1: cpu" in str(err.value)
    assert ctx.worker_for(Partition(("a",), tag="cpu")) == 1
    assert ctx.worker_for(Partition(("a",), rank=2)) == 2
    with pytest.raises(PlacementError, match="pinned to rank 5"):
        ctx.worker_for(Partition(("a",), rank=5))


def test_a_partition_needs_exactly_one_target():
    with pytest.raises(ConfigError, match="exactly one of rank"):
        strategy("model-parallel", partitions=[{"nodes": ["a"]}])


def test_state_from_a_missing_file_names_state_from_not_resume(tmp_path):
    with pytest.raises(ConfigError) as err:
        meshkit.plugins.create("strategy", "model-parallel",
                               {"state_from": str(tmp_path / "nope.npz")})
    assert "state_from" in str(err.value) and "--resume" not in str(err.value)


# -- refusals and unknown names ------------------------------------------------


def test_population_based_is_refused_saying_why_and_what_instead():
    with pytest.raises(meshkit.RefusedError) as err:
        strategy("population-based")
    message = str(err.value)
    assert "not a distribution strategy" in message
    assert "own hyperparameters" in message and "executor" in message


def test_custom_is_refused_saying_it_needs_a_coordinator_and_what_instead():
    with pytest.raises(meshkit.RefusedError) as err:
        strategy("custom")
    message = str(err.value)
    assert "user-provided coordinator" in message
    assert "meshkit_strategies()" in message and "federated" in message


def test_an_unknown_strategy_names_the_installed_ones_and_never_falls_back():
    with pytest.raises(meshkit.UnknownComponentError) as err:
        strategy("gossip")
    message = str(err.value)
    assert "no strategy named 'gossip'" in message
    for name in ("data-parallel", "federated", "local", "model-parallel"):
        assert name in message


def test_without_accept_failures_a_worker_error_stops_the_run_with_the_workers_message():
    class Broken(ShardMean):
        def fit(self, state, x, y, *, seed):
            raise ValueError("bad shard")

    with pytest.raises(MeshError, match="rank 1: fit: ValueError: bad shard"):
        strategy("federated", rounds=1, accept_failures=False).run(make_ctx(Broken(8)))


def test_a_task_failing_everywhere_still_stops_a_federated_run_naming_the_error():
    # Accepting failures: every rank is dropped for the round, so min_clients stops it.
    class Broken(ShardMean):
        def fit(self, state, x, y, *, seed):
            raise ValueError("shape mismatch")

    ctx = make_ctx(Broken(8), ranks=(1, 2))
    with pytest.raises(MeshError, match="shape mismatch"):
        meshkit.plugins.create("strategy", "federated", {"rounds": 1}).run(ctx)


def test_a_stop_request_ends_the_run_between_rounds():
    ctx = make_ctx(ShardMean(8))
    ctx.on_round = lambda report, state: ctx.stop.set()
    with pytest.raises(MeshError, match="stopped"):
        strategy("federated", rounds=5).run(ctx)


def test_losing_the_only_worker_is_a_peer_lost_error_naming_it():
    ctx = make_ctx(ShardMean(8), ranks=(1,), fail=lambda rank, request: "gone")
    with pytest.raises(PeerLostError) as err:
        strategy("local", rounds=1).run(ctx)
    assert "0 worker(s) left" in str(err.value) and "rank 1 (gone)" in str(err.value)


def test_data_parallel_continues_with_the_surviving_replicas():
    lost = {"after": 2}

    def fail(rank, request):
        if rank == 2 and request["op"] == "grads":
            lost["after"] -= 1
            if lost["after"] < 0:
                return "connection reset"
        return None

    reports = []
    ctx = make_ctx(ShardMean(8), ranks=(1, 2, 3), fail=fail,
                   aggregator=meshkit.plugins.create("aggregator", "allreduce"),
                   on_round=lambda report, state: reports.append(report))
    result = strategy("data-parallel", rounds=2, steps=2, min_workers=2).run(ctx)
    assert float(result.state["m"][0]) == pytest.approx(-4.0), "every step still happened"
    assert reports[1].answered == (1, 3) and reports[1].dropped == (2,)
    # After the loss, shards are re-cut over the survivors.
    last = [req for rank, req in ctx.pool.log if req["op"] == "grads"][-2:]
    assert [req["shards"] for req in last] == [2, 2]
