"""The flat compressed round under a linear rule: each payload summed chunk by chunk, exactly.

A compressed round the batched paths do not take (one fit a worker, a round deadline,
FedBN local keys, ``batch=False``) is played flat; with an exact weighted mean its fold
is a :class:`~meshkit.compression.CompressedSum` fed each payload as it came
(``PayloadFold``), never a float copy of a contribution:

* its result is the bits of an exact sum (``FixedPointSum``) of the decoded contributions,
  and the compressed batched round's bits for the same clients;
* a payload that does not decode or is not finite costs its sender's rank, its client is
  served again elsewhere, and the sum holds only the honest contributions;
* FedBN's own keys and error feedback's residuals are kept per client, as before;
* a robust rule still decodes each contribution (it needs individual updates);
* folding one payload of an 8 MiB model allocates a small fraction of one float copy of it
  (tracemalloc), where decoding it whole allocates more than a copy.
"""

from __future__ import annotations

import tracemalloc
from typing import Any

import numpy as np
import pytest

import meshkit.plugins
from meshkit.aggregation import FixedPointSum
from meshkit.compression import DECODE_STEP, SEP, CompressionPlan, decode_contribution, residual_name
from meshkit.train import LocalPool, StrategyContext, Trainer, fold_round
from meshkit.train._local_keys import ClientLocal
from meshkit.train._rounds import compressed as compressed_round

from tests.support.rounds import fits, same_bytes, synthetic


def plan(name: str = "quantize", **options: Any) -> CompressionPlan:
    options = options or {"bits": 8}
    return CompressionPlan(name, options, meshkit.plugins.create("compression", name, options))


def context(chosen: CompressionPlan, workers: int = 2, aggregator: str = "fedavg",
            trainers: dict[int, Trainer] | None = None, task: Any = synthetic,
            local: frozenset[str] = frozenset()) -> StrategyContext:
    ranks = list(range(1, workers + 1))
    pool = LocalPool({r: (trainers or {}).get(r) or Trainer(task()) for r in ranks})
    return StrategyContext(
        task=task(), aggregator=meshkit.plugins.create("aggregator", aggregator), pool=pool,
        workers=ranks, rng=np.random.default_rng(0),
        outer=meshkit.plugins.create("outer_optimizer", "average"), timeout=30.0,
        compression=chosen, client_local=ClientLocal(keys=local), inline_bytes=0)


def decoded(chosen: CompressionPlan, state: dict, clients: int,
            raw: tuple[str, ...] = ()) -> list[tuple[dict, int, dict]]:
    """Each client's fit, compressed and decoded at the coordinator whole (the flat round's
    contributions before), with its examples and residuals; ``raw`` keys travel whole."""
    out = []
    for work in fits(clients):
        trainer = Trainer(synthetic())
        trainer.handle({"op": "set_state", "state": state})
        reply = trainer.handle({**work.request, "compress": chosen.request(raw)})
        contribution, residuals = decode_contribution(chosen.compressor, reply["state"], state,
                                                      raw=raw)
        out.append((contribution, int(reply["examples"]), residuals))
    return out


def exact(contributions: list[tuple[dict, int, dict]],
          skip: frozenset[str] = frozenset()) -> dict:
    """The exact sum (``FixedPointSum``) of ``contributions`` without their ``skip`` keys."""
    total = FixedPointSum()
    for i, (state, examples, _) in enumerate(contributions):
        total.add({k: v for k, v in state.items() if k not in skip}, examples,
                  source=f"client {i}")
    return total.result()


def counted(monkeypatch) -> dict[str, int]:
    """How often the round decoded a payload whole, and how many payloads it summed."""
    calls = {"decode": 0, "payload": 0}
    decode, add = compressed_round.Unpacker.decode, compressed_round.PayloadFold.add

    def whole(self, *args, **kwargs):
        calls["decode"] += 1
        return decode(self, *args, **kwargs)

    def summed(self, *args, **kwargs):
        calls["payload"] += 1
        return add(self, *args, **kwargs)

    monkeypatch.setattr(compressed_round.Unpacker, "decode", whole)
    monkeypatch.setattr(compressed_round.PayloadFold, "add", summed)
    return calls


@pytest.mark.parametrize("name, options", [("quantize", {"bits": 8}), ("quantize", {"bits": 2}),
                                           ("top-k", {"fraction": 0.05,
                                                      "error_feedback": False})])
def test_the_flat_round_sums_payloads_to_the_exact_sum_of_the_decoded_contributions(
        monkeypatch, name, options):
    chosen = plan(name, **options)
    state = context(chosen).task.init_state(0)
    want = exact(decoded(chosen, state, 6))
    calls = counted(monkeypatch)
    # One fit a worker (6 workers), a deadline, and batch=False: each plays flat.
    for ctx, kwargs in ((context(chosen, workers=6), {}),
                        (context(chosen, workers=2), {"deadline": 600.0}),
                        (context(chosen, workers=3), {"batch": False})):
        folded = fold_round(ctx, fits(6), state=state, **kwargs)
        assert sorted(folded.served) == list(range(6)) and folded.failed == {}
        assert not any(r.get("op") == "fit_batch" for _, r in ctx.pool.log)
        assert same_bytes(folded.result, want), kwargs
    assert calls == {"decode": 0, "payload": 18}
    # The compressed batched round (two workers, three fits each): the same bits.
    batched = context(chosen, workers=2)
    folded = fold_round(batched, fits(6), state=state)
    assert any(r.get("op") == "fit_batch" for _, r in batched.pool.log)
    assert same_bytes(folded.result, want)


class Corrupting(Trainer):
    """A worker whose every compressed payload has an infinite scale in its last chunk: it
    passes the bounds check and is refused only once some chunks were summed."""

    def handle(self, request: Any) -> dict[str, Any]:
        reply = super().handle(request)
        if request.get("op") in ("fit", "take") and isinstance(reply.get("state"), dict):
            state = dict(reply["state"])
            for key in [k for k in state if k.endswith(f"{SEP}lo")]:
                state[key] = state[key].copy()
                state[key][-1] = np.inf
            reply = {**reply, "state": state}
        return reply


def test_a_payload_the_sum_refuses_costs_its_sender_and_the_sum_holds_the_honest_ones():
    chosen = plan("quantize", bits=8, chunk=64)
    ctx = context(chosen, workers=3, trainers={2: Corrupting(synthetic())})
    state = ctx.task.init_state(0)
    folded = fold_round(ctx, fits(6), state=state, batch=False)
    assert list(folded.failed) == [2] and "does not decode" in folded.failed[2]
    assert sorted(folded.served) == list(range(6)) and 2 not in folded.served.values()
    assert same_bytes(folded.result, exact(decoded(chosen, state, 6)))


def test_fedbn_local_keys_and_residuals_are_kept_per_client_and_left_out_of_the_sum():
    chosen = plan("top-k", fraction=0.05)  # error feedback: a residual a client
    store = ClientLocal(keys=frozenset({"w1"}))
    ctx = context(chosen, workers=2, local=frozenset({"w1"}))
    state = ctx.task.init_state(0)
    folded = fold_round(ctx, fits(4), state=state, local=store)
    assert sorted(folded.served) == [0, 1, 2, 3] and folded.failed == {}
    assert sorted(folded.result) == ["w0"]
    kept = ctx.client_local
    assert kept.keys == {"w1", residual_name("w0")} and kept.clients == 4
    contributions = decoded(chosen, state, 4, raw=("w1",))
    assert same_bytes(folded.result, exact(contributions, skip=frozenset({"w1"})))
    for client, (contribution, _, residuals) in enumerate(contributions):
        own = kept.of(client)
        assert own["w1"].tobytes() == contribution["w1"].tobytes()
        assert own[residual_name("w0")].tobytes() == residuals[residual_name("w0")].tobytes()
        assert np.abs(residuals[residual_name("w0")]).max() > 0


def test_a_robust_rule_still_decodes_each_contribution(monkeypatch):
    chosen = plan()
    calls = counted(monkeypatch)
    ctx = context(chosen, workers=2, aggregator="median")
    state = ctx.task.init_state(0)
    folded = fold_round(ctx, fits(5), state=state)
    assert calls == {"decode": 5, "payload": 0}
    rule = meshkit.plugins.create("aggregator", "median")
    want = rule.aggregate([c for c, _, _ in decoded(chosen, state, 5)])
    assert same_bytes(folded.result, want)


def _large() -> Any:
    return meshkit.plugins.create("task", "synthetic", {"params": 1 << 21, "arrays": 1,
                                                        "rows": 64})


def test_folding_a_payload_of_an_8_mib_model_holds_no_float_copy_of_it(monkeypatch):
    chosen = plan()
    ctx = context(chosen, workers=2, task=_large)
    state = ctx.task.init_state(0)
    copy = sum(v.nbytes for v in state.values() if isinstance(v, np.ndarray))
    assert copy >= 8 << 20
    peaks: list[int] = []
    add = compressed_round.PayloadFold.add

    def measured(self, *args, **kwargs):
        # The LocalPool's fits run outside this call: only the coordinator's fold counts.
        tracemalloc.start()
        try:
            return add(self, *args, **kwargs)
        finally:
            peaks.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()

    monkeypatch.setattr(compressed_round.PayloadFold, "add", measured)
    folded = fold_round(ctx, fits(2), state=state, batch=False)
    assert sorted(folded.served) == [0, 1] and len(peaks) == 2
    # A chunk's scratch (DECODE_STEP coordinates decoded at a time), whatever the model.
    assert max(peaks) < min(copy / 8, 64 * DECODE_STEP), (peaks, copy)
    # What today's decode of one payload allocates, for comparison: more than a copy.
    trainer = Trainer(_large())
    trainer.handle({"op": "set_state", "state": state})
    payload = trainer.handle({**fits(1)[0].request, "compress": chosen.request()})["state"]
    tracemalloc.start()
    try:
        decode_contribution(chosen.compressor, payload, state)
        whole = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert whole > copy, (whole, copy)
