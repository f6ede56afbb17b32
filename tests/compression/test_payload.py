"""The compressed payload: what the coordinator accepts, what it refuses before decoding, and
what a worker that sends a malformed one costs (its rank, for the round; never the round)."""

from __future__ import annotations

import numpy as np
import pytest

import meshkit.plugins
from meshkit.compression import (SEP, CompressionPlan, check_model_keys, decode_contribution,
                                 encode_update, residual_name)
from meshkit.errors import ConfigError, ProtocolError
from meshkit.train import Trainer, fold_round

from tests.support.rounds import fits, make_ctx, synthetic


def _quantize():
    return meshkit.plugins.create("compression", "quantize", {"bits": 4, "chunk": 64})


def _round_trip_inputs():
    rng = np.random.default_rng(0)
    start = {"w": rng.standard_normal((10, 20)).astype(np.float32), "n": np.array([2]),
             "bn": np.ones(3), "meta": {"a": 1}}
    fitted = {**start, "w": start["w"] + 0.1, "n": np.array([3]), "bn": np.full(3, 2.0)}
    return start, fitted


def test_a_payload_round_trips_with_its_raw_keys_whole():
    start, fitted = _round_trip_inputs()
    payload, _ = encode_update(_quantize(), start, fitted, seed=4, raw=["bn"])
    assert sorted(payload) == sorted(["n", "bn", "meta", f"w{SEP}codes", f"w{SEP}lo",
                                      f"w{SEP}step"])
    assert payload["bn"] is fitted["bn"]
    state, residual = decode_contribution(_quantize(), payload, start, raw=["bn"])
    assert residual == {}
    assert state["n"].tolist() == [3] and state["bn"].tolist() == [2.0, 2.0, 2.0]
    np.testing.assert_allclose(state["w"], fitted["w"], atol=0.2 / 15 * 2)


@pytest.mark.parametrize("break_it, words", [
    (lambda p: p.pop(f"w{SEP}lo"), "field 'lo' is missing"),
    (lambda p: p.update({f"w{SEP}codes": p[f"w{SEP}codes"].astype(np.uint16)}),
     "field 'codes' is uint16"),
    (lambda p: p.update({f"w{SEP}codes": np.zeros(10 ** 6, np.uint8)}), "at most 100"),
    (lambda p: p.update({f"w{SEP}codes": p[f"w{SEP}codes"][:-1]}), "does not decode"),
    (lambda p: p.update({f"w{SEP}step": np.full(4, np.inf, np.float32)}), "not finite"),
    (lambda p: p.update({"extra": np.zeros(3)}), "no place for"),
    (lambda p: p.pop("n"), "lacks key 'n'"),
])
def test_a_malformed_payload_is_a_protocol_error_before_anything_is_decoded(break_it, words):
    start, fitted = _round_trip_inputs()
    payload, _ = encode_update(_quantize(), start, fitted, seed=4)
    break_it(payload)
    with pytest.raises(ProtocolError, match="client 3") as caught:
        decode_contribution(_quantize(), payload, start, what="client 3")
    assert words in str(caught.value)


def test_top_k_indices_must_be_ascending_distinct_and_in_range():
    top = meshkit.plugins.create("compression", "top-k", {"fraction": 0.1,
                                                          "error_feedback": False})
    x = np.arange(50, dtype=np.float32)
    fields = top.encode(x, seed=0)
    for index in (fields["index"][::-1].copy(), np.full(5, 3, np.uint32),
                  np.array([1, 2, 3, 4, 50], np.uint32)):
        with pytest.raises(ValueError, match="ascending, distinct and below 50"):
            top.decode({**fields, "index": index}, 50)


def test_error_feedback_residuals_must_come_back_whole():
    top = meshkit.plugins.create("compression", "top-k", {"fraction": 0.1})
    start, fitted = _round_trip_inputs()
    payload, residual = encode_update(top, start, fitted, seed=1)
    assert sorted(residual) == [residual_name("bn"), residual_name("w")]
    payload[residual_name("w")] = payload[residual_name("w")][:-1]
    with pytest.raises(ProtocolError, match="residual is missing or not float32\\[200\\]"):
        decode_contribution(top, payload, start)


def test_a_model_key_holding_the_separator_is_refused():
    with pytest.raises(ConfigError, match="unit separator"):
        check_model_keys({f"a{SEP}b": np.zeros(2)}, "job.toml: [compression]")


class Corrupting(Trainer):
    """An honest fit, then a truncated payload when the coordinator takes it (the flat
    round), or in the first fit's payload of each batch (the batched round)."""

    def handle(self, request):
        reply = super().handle(request)
        if request.get("op") == "take" and "state" in reply:
            state = dict(reply["state"])
            name = next(k for k in state if k.endswith(f"{SEP}codes"))
            state[name] = state[name][:-1]
            reply["state"] = state
        if request.get("op") == "fit_batch" and "payloads" in reply:
            first = f"{request['fits'][0]['key']}/"
            payloads = dict(reply["payloads"])
            name = next(k for k in payloads if k.startswith(first) and k.endswith("codes"))
            payloads[name] = payloads[name][:-1]
            reply["payloads"] = payloads
        return reply


@pytest.mark.parametrize("batch", [False, True])
def test_a_worker_sending_a_malformed_payload_loses_the_round_and_its_clients_are_served_again(
        batch):
    honest = make_ctx(workers=2)
    plan = CompressionPlan("quantize", {"bits": 8}, meshkit.plugins.create(
        "compression", "quantize", {"bits": 8}))
    honest.compression = plan
    state = honest.task.init_state(0)
    expected = fold_round(honest, fits(6), state=state, batch=batch)
    assert expected.failed == {} and len(expected.served) == 6
    ops = [r["op"] for _, r in honest.pool.log if r.get("op") in ("fit", "fit_batch")]
    assert set(ops) == {"fit_batch" if batch else "fit"}
    assert all(r["compress"]["name"] == "quantize" for _, r in honest.pool.log
               if r.get("op") in ("fit", "fit_batch"))
    plain = fold_round(make_ctx(workers=2), fits(6), state=state, batch=False).result
    for key, value in plain.items():  # compressed: close to the plain mean, not the same bits
        if isinstance(value, np.ndarray) and value.dtype.kind == "f":
            assert value.tobytes() != expected.result[key].tobytes(), key
            np.testing.assert_allclose(expected.result[key], value, atol=0.05)
    hostile = make_ctx(workers=2)
    hostile.compression = plan
    hostile.pool.trainers[2] = Corrupting(synthetic())
    folded = fold_round(hostile, fits(6), state=state, batch=batch)
    assert set(folded.failed) == {2} and "protocol error" in folded.failed[2]
    assert "does not decode" in folded.failed[2]
    assert sorted(folded.served) == list(range(6)) and set(folded.served.values()) == {1}
    for key, value in expected.result.items():  # every fit a pure function of its client
        assert folded.result[key].tobytes() == value.tobytes(), key


def test_a_batched_compressed_round_keeps_each_residual_and_its_bits_ignore_the_workers():
    plan = CompressionPlan("top-k", {"fraction": 0.1}, meshkit.plugins.create(
        "compression", "top-k", {"fraction": 0.1}))
    runs = {}
    for batch, workers in ((False, 2), (True, 2), (True, 3)):
        ctx = make_ctx(workers=workers)
        ctx.compression = plan
        state = ctx.task.init_state(0)
        kept = []
        for rnd in (1, 2):
            folded = fold_round(ctx, fits(8, rnd), state=state, batch=batch)
            assert sorted(folded.served) == list(range(8)) and folded.failed == {}
            state = folded.result
            kept.append({c: ctx.client_local.of(c) for c in range(8)})
        ops = {r["op"] for _, r in ctx.pool.log if r.get("op") in ("fit", "fit_batch")}
        assert ops == {"fit_batch" if batch else "fit"}
        runs[(batch, workers)] = state, kept
    # Round 1 starts every run from the same model: each client's residual is its own.
    flat, batched, more = runs[(False, 2)], runs[(True, 2)], runs[(True, 3)]
    for client in range(8):
        for name, value in flat[1][0][client].items():
            assert value.tobytes() == batched[1][0][client][name].tobytes(), (client, name)
        assert any(np.abs(v).max() > 0 for v in batched[1][0][client].values())
    # The batched sum is exact and order-free: 2 or 3 workers, the same bits, round after round.
    for key, value in batched[0].items():
        assert value.tobytes() == more[0][key].tobytes(), key
    for client in range(8):
        for name, value in batched[1][1][client].items():
            assert value.tobytes() == more[1][1][client][name].tobytes(), (client, name)
