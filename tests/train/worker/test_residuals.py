"""A worker's store of its clients' error-feedback residuals, two generations a client
(meshkit/train/_worker/residuals.py)."""

from __future__ import annotations

import gc

import numpy as np

from meshkit.compression import residual_name
from meshkit.train._worker.residuals import WorkerResiduals


def _values(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {residual_name("w"): rng.standard_normal(50).astype(np.float32),
            residual_name("b"): rng.standard_normal(5).astype(np.float32)}


def test_the_worker_feeds_back_the_generation_the_coordinator_names():
    store = WorkerResiduals()
    assert store.take(3, None) == {}
    store.keep(3, 11, None, _values(1))  # round 1's fit, seeded 11
    # Round 2 names fit 11 (it was folded): its residual, under the model's keys.
    fed = store.take(3, 11)
    assert sorted(fed) == ["b", "w"]
    assert fed["w"].tobytes() == _values(1)[residual_name("w")].tobytes()
    store.keep(3, 12, 11, _values(2))
    # Round 2 played again (a replay, a lost reply): the same fit starts from fit 11's again.
    assert store.take(3, 11)["w"].tobytes() == _values(1)[residual_name("w")].tobytes()
    store.keep(3, 12, 11, _values(2))
    # Round 3, fit 12 folded: its residual; fit 11's is then written over.
    assert store.take(3, 12)["w"].tobytes() == _values(2)[residual_name("w")].tobytes()
    store.keep(3, 13, 12, _values(3))
    assert store.take(3, 12)["b"].tobytes() == _values(2)[residual_name("b")].tobytes()
    assert store.take(3, 13)["b"].tobytes() == _values(3)[residual_name("b")].tobytes()
    # A generation it never held (a restarted process): zero, counted.
    assert store.take(3, 11) == {} and store.take(4, 12) == {}
    assert store.missing == 2


def test_the_worker_spills_its_residuals_to_its_own_directory_past_the_bound():
    store = WorkerResiduals(memory_bytes=20000)  # a record is 220 bytes: 64 fit, 128 do not
    for client in range(40):
        store.keep(client, 1000 + client, None, _values(client))
    assert not store.spilled
    for client in range(40, 200):
        store.keep(client, 1000 + client, None, _values(client))
    assert store.spilled
    spill = store._dir
    assert spill is not None and any(spill.iterdir())
    for client in (0, 77, 199):
        got = store.take(client, 1000 + client)
        assert got["w"].tobytes() == _values(client)[residual_name("w")].tobytes()
    del store
    gc.collect()
    assert not spill.exists()  # the worker's directory goes with it
