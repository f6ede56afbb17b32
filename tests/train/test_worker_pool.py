"""GroupPool and serve_trainer over a real Group (the inproc transport): the trainer protocol end to end."""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest

import meshkit.plugins
from meshkit.errors import MeshError, WorkerError
from meshkit.node.config import NodeConfig
from meshkit.train import TAG_REPLY, TAG_REQUEST, GroupPool, LocalPool, StrategyContext
from meshkit.train import decode, encode, serve_trainer

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
    assert "stalled" in ctx.dead[3]
    assert reports[0].clients == (0, 1, 2), "rank 3's client was served by a live worker"
    assert 3 in groups[0].dead, "the transport's ledger hears about the drop"
    assert reports[1].answered == (1, 2)


def test_a_worker_that_cannot_build_the_task_says_why_instead_of_stalling(mesh):
    start, _, _ = mesh
    groups = start(2, timeout=3.0)
    raised = []

    def worker():
        # This worker's [task] options are refused (a node-local problem).
        try:
            serve_trainer(groups[1], {"task": "digits", "task_options": {"hidden": -1},
                                      "seed": 0})
        except MeshError as exc:
            raised.append(exc)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    ctx = context(groups[0], [1], timeout=3.0)
    with pytest.raises(MeshError) as err:
        meshkit.plugins.create("strategy", "federated",
                               {"rounds": 1, "accept_failures": False}).run(ctx)
    # The worker said why: a WorkerError naming it, not a lost peer (accepting
    # failures, the round's refusal names the same reason: test_failures.py).
    assert type(err.value) is WorkerError and err.value.rank == 1
    assert "rank 1: cannot build the task on this worker" in str(err.value)
    assert "hidden must be a finite number > 0" in str(err.value)
    ctx.pool.stop_all([1])
    thread.join(10)
    assert raised and "hidden" in str(raised[0])


@pytest.mark.parametrize("reply, why", [
    (lambda seq: {"examples": 1, "metrics": {}, "kept": 0}, "seq: missing"),
    (lambda seq: {"seq": seq + 5, "examples": 1, "metrics": {}, "kept": 0},
     "echoes seq"),
    (lambda seq: {"seq": seq, "examples": "many", "metrics": {}, "kept": 0},
     "examples: expected an integer"),
    (lambda seq: {"seq": seq, "state": 5, "state/w": np.zeros(2)}, "without its count"),
])
def test_a_reply_that_does_not_fit_over_a_group_drops_that_rank_with_the_reason(
        mesh, reply, why):
    start, _, _ = mesh
    groups = start(3, timeout=5.0)
    pool = GroupPool(groups[0])

    def worker():
        request = decode(groups[1].recv(0, TAG_REQUEST, timeout=5.0))
        # A late (stale) answer first: discarded, not a breach.
        groups[1].send(0, TAG_REPLY, encode({"seq": request["seq"] - 1}))
        groups[1].send(0, TAG_REPLY, encode(reply(request["seq"])))

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    ticket = pool.send(1, {"op": "fit", "shard": 0, "shards": 1, "seed": 0, "keep": 0}, 5.0)
    got = pool.receive()
    thread.join(10)
    assert got.seq == ticket and not got.ok
    assert got.error.startswith("protocol error") and why in got.error, got.error
    assert "protocol error" in pool.dead[1] and 2 not in pool.dead


def test_a_worker_answers_a_request_that_does_not_fit_and_serves_on(mesh):
    start, reports, threads = mesh
    groups = start(2, serve=(1,))
    for frame, why in (({"op": "fit", "seq": 3, "state": 5, "state/w": np.zeros(2)},
                        "without its count"),
                       ({"op": "fit", "seq": 4, "shard": 0, "shards": 1, "seed": "x"},
                        "seed: expected an integer"),
                       ({"op": ["stop"], "seq": 5}, "unknown trainer request op")):
        groups[0].send(1, TAG_REQUEST, frame)
        reply = groups[0].recv(1, TAG_REPLY, timeout=10)
        assert reply["seq"] == frame["seq"] and why in reply["error"], reply
        assert reply["error"].startswith("protocol error")
    pool = GroupPool(groups[0])
    ticket = pool.send(1, {"op": "held_out"}, 10.0)
    got = pool.receive()
    assert got.seq == ticket and got.ok and got.payload["examples"] > 0
    pool.stop_all([1])
    for t in threads:
        t.join(10)
    assert reports[1].stopped is None


class UnsendableReplica:
    """digits, whose inner optimizer state holds a complex array: no wire dtype carries it,
    so a DiLoCo replica's ``replica_get`` reply cannot be encoded."""

    def __init__(self) -> None:
        self._task = meshkit.plugins.create("task", "digits", SPEC["task_options"])

    def __getattr__(self, name):
        return getattr(self._task, name)

    def optimizer_state(self):
        return {"moment": np.array([1 + 2j])}


def test_a_reply_the_wire_cannot_carry_is_an_error_reply_and_the_worker_serves_on(mesh):
    start, reports, threads = mesh
    groups = start(2)
    spec = {**SPEC, "task": f"{__name__}:UnsendableReplica", "task_options": {}}
    worker = threading.Thread(
        target=lambda: reports.__setitem__(1, serve_trainer(groups[1], spec)), daemon=True)
    worker.start()
    threads.append(worker)
    state = meshkit.plugins.create("task", "digits", SPEC["task_options"]).init_state(0)
    # A timeout far above how long an error reply takes: the old worker ended its job
    # on the unsendable reply, and this pool would only have heard "stalled".
    pool = GroupPool(groups[0])
    init = {"op": "replica_init", "state": state, "fragments": 1, "bits": 8}
    get = {"op": "replica_get"}
    inner = {"op": "inner", "steps": 1, "shard": 0, "shards": 1, "batch_size": 8, "seed": 0,
             "step": 0}
    replies = []
    for request in (init, get, inner):
        ticket = pool.send(1, request, 60.0)
        replies.append(pool.receive())
        assert replies[-1].seq == ticket
    started, handed, stepped = replies
    assert started.ok and stepped.ok, (started.error, stepped.error)
    assert handed.payload is not None, f"no error reply: {handed.error}"
    why = handed.payload["error"]
    assert why.startswith("replica_get: the reply could not be sent: "), why
    assert "'optimizer/moment': arrays of dtype complex128 are not supported" in why, why
    assert 1 not in pool.dead, "an error reply is a member's failure, not a lost rank"
    pool.stop_all([1])
    worker.join(10)
    assert reports[1].stopped is None
    assert "replica_get: the reply could not be sent" in reports[1].error


def test_a_direct_local_pool_keeps_no_log_and_gives_its_trainer_a_copy_of_the_state() -> None:
    pool = LocalPool.of(lambda: meshkit.plugins.create("task", "digits"), [1], direct=True)
    state = meshkit.plugins.create("task", "digits").init_state(0)
    pool.send(1, {"op": "set_state", "state": state}, None)
    assert pool.receive().ok
    held = pool.trainers[1].state
    assert all(not np.shares_memory(held[k], v) for k, v in state.items())
    assert pool.log == []  # a long collective run holds no request of any round


def test_the_pool_sees_a_death_and_an_admission_after_it_kept_its_copy_of_the_ledger(mesh):
    start, _, _ = mesh
    groups = start(3, timeout=5.0)
    pool = GroupPool(groups[0], admitted={1})
    assert pool.live([1, 2]) == [1]  # the copy is kept from here on
    pool.admitted.add(2)  # the runner admits in place, between rounds
    assert pool.live([1, 2]) == [1, 2]
    groups[0].declare_dead(2, "closed its connection")
    assert pool.live([1, 2]) == [1]
    ticket = pool.send(2, {"op": "held_out"}, 5.0)
    got = pool.receive()
    assert got.seq == ticket and not got.ok and "closed its connection" in got.error
