"""``[compression] residual = "worker"``, its parts in one process: the pins, the worker's
store of residual generations, the payload check and the messages.

End to end (real processes, the bytes on the wire): test_worker_residual.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from meshkit import plugins
from meshkit.compression import CompressionPlan, check_compression, encode_update
from meshkit.compression import decode_contribution, residual_name
from meshkit.errors import ProtocolError, RefusedError
from meshkit.train._messages import check_request
from meshkit.train._rounds.pins import ResidualPins, pin
from meshkit.train._worker.residuals import WorkerResiduals


def test_a_lost_rank_moves_only_its_own_clients():
    before = {c: pin(c, [1, 2, 3]) for c in range(300)}
    after = {c: pin(c, [1, 3]) for c in range(300)}
    assert {r: sum(1 for v in before.values() if v == r) for r in (1, 2, 3)} == \
        pytest.approx({1: 100, 2: 100, 3: 100}, abs=30)  # spread over the ranks
    for c in range(300):
        if before[c] != 2:
            assert after[c] == before[c], c  # nobody else's residual is stranded
        else:
            assert after[c] in (1, 3)
    assert {c: pin(c, [3, 2, 1]) for c in range(300)} == before  # order does not matter


def test_pins_name_the_last_folded_fit_and_count_a_client_that_moved():
    pins = ResidualPins()
    first = pins.plan([(0, None), (1, None), (2, 7)], [1, 2])
    assert first[2] == (7, {"client": 2})  # a client already pinned keeps its rank
    assert all("from" not in field for _, field in first.values())
    requests = {c: {"seed": 100 + c} for c in (0, 1, 2)}
    pins.folded({0: first[0][0], 2: 7}, requests)  # client 1 was not folded
    second = pins.plan([(0, None), (1, None), (2, 7)], [1, 2])
    assert second[0][1] == {"client": 0, "from": 100}
    assert second[1][1] == {"client": 1}  # no fit of it was folded: zero
    assert second[2][1] == {"client": 2, "from": 102}
    assert pins.round_restarts == 0
    gone = first[0][0]
    third = pins.plan([(0, None)], [r for r in (1, 2) if r != gone])
    assert third[0] == ({1: 2, 2: 1}[gone], {"client": 0})
    assert pins.round_restarts == pins.restarts == 1


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
    import gc
    gc.collect()
    assert not spill.exists()  # the worker's directory goes with it


def _topk():
    return plugins.create("compression", "top-k", {"fraction": 0.1})


def test_a_payload_that_carries_a_residual_is_refused_when_the_worker_keeps_it():
    rng = np.random.default_rng(0)
    start = {"w": rng.standard_normal(40)}
    fitted = {"w": start["w"] + rng.standard_normal(40)}
    payload, kept = encode_update(_topk(), start, fitted, seed=3)
    assert set(kept) == {residual_name("w")} and set(kept) <= set(payload)
    decode_contribution(_topk(), payload, start)  # the coordinator's store: expected
    with pytest.raises(ProtocolError, match="no place for"):
        decode_contribution(_topk(), payload, start, residuals=False)
    sent = {k: v for k, v in payload.items() if k not in kept}
    state, residuals = decode_contribution(_topk(), sent, start, residuals=False)
    assert residuals == {} and state["w"].shape == (40,)


def test_residual_worker_needs_error_feedback():
    plan = CompressionPlan("quantize", {}, plugins.create("compression", "quantize", {}),
                           residual="worker")
    with pytest.raises(RefusedError, match="CompressionTraits.stateful"):
        check_compression(plan, where="job.toml", private_client_clip=False, secure=None)
    plan = CompressionPlan("top-k", {}, _topk(), residual="worker")
    check_compression(plan, where="job.toml", private_client_clip=False, secure=None)
    assert plan.worker_residual and not plan.residuals_travel


def test_a_fit_names_its_client_and_generation_and_a_batch_names_none():
    compress = {"name": "top-k", "options": {}, "raw": []}
    fit = {"op": "fit", "seq": 1, "shard": 0, "shards": 4, "seed": 5,
           "compress": {**compress, "residual": {"client": 3, "from": 2 ** 63}}}
    check_request(fit)
    with pytest.raises(ProtocolError, match="residual"):
        check_request({**fit, "compress": {**compress, "residual": {"client": -1}}})
    with pytest.raises(ProtocolError, match="residual"):
        check_request({**fit, "compress": {**compress, "residual": {"client": 1, "x": 2}}})
    batch = {"op": "fit_batch", "seq": 2, "label": "client",
             "fits": [{"key": 0, "shard": 0, "shards": 4, "seed": 5}],
             "compress": {**compress, "residual": {"client": 0}}}
    with pytest.raises(ProtocolError, match="a fit of its own"):
        check_request(batch)
