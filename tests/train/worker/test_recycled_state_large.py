"""A worker's model-sized bodies are reused, never while user code holds them (issue 39).

A worker process that keeps two received bodies above the wire's message size
for reuse (``meshkit.wire.recycle_large_messages(2)``; no train job turns it
on today, docs/wire.md) hands its fits views of them. The state a fit
is given is views of its body, so a task that keeps what it was given (user
code may) must find it unchanged however many later models arrived; and when
nothing holds an old body, a later model is read into its memory.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import meshkit.plugins
from meshkit import wire
from meshkit.node.config import NodeConfig
from meshkit.train import GroupPool, StrategyContext, serve_trainer
from meshkit.wire import _buffers
from meshkit_tasks.synthetic import SyntheticTask

SECRET = b"recycled-state-secret"
SEGMENT = 256 << 10
PARAMS = 400_000  # 1.6 MB of float32: above the lowered message size below
SPEC = {"task": "synthetic", "task_options": {"params": PARAMS, "arrays": 2},
        "strategy": "federated", "seed": 0}


def run_rounds(rounds: int, keep_given: bool, monkeypatch) -> tuple[list, list, set]:
    """``rounds`` federated rounds over TCP, two workers on threads of this process with
    the train job's recycling on; (what each fit was given, copies of it at the time,
    the kept bodies, by slot, the fits' states were views of)."""
    monkeypatch.setattr(_buffers, "_MESSAGE_MAX", 1 << 20)
    monkeypatch.setattr(_buffers, "_large_slots", [])
    given: list = []
    copies: list = []
    bases: set = set()
    fit = SyntheticTask.fit
    lock = threading.Lock()

    def keeping_fit(self, state, x, y, *, seed):
        with lock:
            arrays = [state[k] for k in sorted(state)]
            # Which kept body each given array lives in (none: a fresh one).
            bases.update(i for a in arrays for i, slot in enumerate(_buffers._large_slots)
                         if np.shares_memory(a, slot))
            if keep_given:
                given.append(arrays)  # user code keeping the model it was given
                copies.append([a.copy() for a in arrays])
        return fit(self, state, x, y, seed=seed)

    monkeypatch.setattr(SyntheticTask, "fit", keeping_fit)
    # Segments of 256 KiB: a 1.6 MB model is a segmented message, read into one body.
    hub = NodeConfig(rank=0, world=3, topology="star", bind="127.0.0.1:0", secret=SECRET,
                     timeout=30.0, segment_bytes=SEGMENT).connect()
    workers = [NodeConfig(rank=r, world=3, peers=[hub.address], topology="star",
                          secret=SECRET, timeout=30.0, segment_bytes=SEGMENT).connect()
               for r in (1, 2)]
    threads = [threading.Thread(target=serve_trainer, args=(g, SPEC), daemon=True)
               for g in workers]
    wire.recycle_large_messages(2)  # for the rounds' length, as a worker would
    try:
        for t in threads:
            t.start()
        assert hub.wait_for_workers(timeout=10) == [1, 2]
        ctx = StrategyContext(
            task=meshkit.plugins.create("task", "synthetic", SPEC["task_options"]),
            aggregator=meshkit.plugins.create("aggregator", "fedavg"),
            pool=GroupPool(hub), workers=[1, 2], rng=np.random.default_rng(0),
            outer=meshkit.plugins.create("outer_optimizer", "average"), timeout=30.0)
        meshkit.plugins.create("strategy", "federated", {"rounds": rounds}).run(ctx)
        ctx.pool.stop_all([1, 2])
        for t in threads:
            t.join(20)
    finally:
        wire.recycle_large_messages(0)
        for group in (*workers, hub):
            group.close()
    return given, copies, bases


def test_a_model_a_task_kept_is_never_overwritten_by_later_rounds(monkeypatch):
    given, copies, _ = run_rounds(5, keep_given=True, monkeypatch=monkeypatch)
    assert len(given) == 10  # a fit per worker per round
    for arrays, saved in zip(given, copies):
        for array, copy in zip(arrays, saved):
            np.testing.assert_array_equal(array, copy)
    # Every round's model is a different one (the fits moved it), so an overwritten
    # body could not have passed for the right one.
    assert not np.array_equal(copies[0][0], copies[-1][0])


def test_a_body_nothing_holds_is_reused_for_a_later_model(monkeypatch):
    _, _, bases = run_rounds(5, keep_given=False, monkeypatch=monkeypatch)
    # Later models were given to the fits in kept bodies (the process's slots are
    # shared by both workers here, and the coordinator's received contributions).
    assert bases
