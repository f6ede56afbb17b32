"""``[compression] residual = "worker"`` in the compression kernel and the messages: a
payload that carries a residual is refused, the option needs error feedback, a fit names
its client and generation (the pins: tests/train/rounds/test_pins.py; the worker's store:
tests/train/worker/test_residuals.py; end to end: test_worker_residual.py)."""

from __future__ import annotations

import numpy as np
import pytest

from meshkit import plugins
from meshkit.compression import CompressionPlan, check_compression, encode_update
from meshkit.compression import decode_contribution, residual_name
from meshkit.errors import ProtocolError, RefusedError
from meshkit.train._messages import check_request


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
    # What a worker keeping the residual encodes: the same payload, its residual left out.
    alone, kept_alone = encode_update(_topk(), start, fitted, seed=3, residuals=False)
    assert set(alone) == set(sent) and all(np.array_equal(alone[k], sent[k]) for k in sent)
    assert np.array_equal(kept_alone[residual_name("w")], kept[residual_name("w")])


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
