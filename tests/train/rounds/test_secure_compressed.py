"""int8 inside the masking field: a secure round whose clients quantise onto one shared grid.

Under ``[compression] name = "quantize"`` a secure round's field is narrowed to
``bits + ceil(log2 n)`` bits: each client's update becomes codes on the round's
grid ``[-clip_range, clip_range]`` (the compressor's ``encode_field``), the scheme
masks the codes, each masked vector travels packed at the field's width, and the
coordinator decodes the unmasked integer sum once. Over in-process workers (every
message crosses the wire encoding and the schema boundary); the bytes a real
transport counts are in ``tests/compression/test_compressed_runs.py``.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import pytest

import meshkit
import meshkit.plugins
from meshkit.compression import CompressionPlan, field_codes, key_seed
from meshkit.secure_aggregation import add_mod, choose, packed_size, vector_dtype
from meshkit.train import LocalPool, StrategyContext, Trainer, secure_sum
from meshkit.train._worker.secure import update_vector, vector_keys

CLIENTS = 10
CLIP = 0.5
# interleave = false: the tests name the clients each rank plays (client order).
TABLE = choose("secagg+", {"degree": 0, "threshold": 5, "clip_range": CLIP, "interleave": False})


def task() -> Any:
    return meshkit.plugins.create("task", "synthetic", {"params": 64, "arrays": 2, "rows": 80})


def quantize(bits: int = 8, **options: Any) -> CompressionPlan:
    options = {"bits": bits, **options}
    return CompressionPlan("quantize", options,
                           meshkit.plugins.create("compression", "quantize", options))


class Recording(Trainer):
    """A worker that keeps its replies to ``secagg_mask`` (what it put on the wire)."""

    def __init__(self) -> None:
        super().__init__(task())
        self.masked: list[dict[str, Any]] = []

    def handle(self, request: Any) -> dict[str, Any]:
        reply = super().handle(request)
        if request.get("op") == "secagg_mask":
            self.masked.append(reply)
        return reply


def context(workers: int, compression: CompressionPlan | None,
            trainers: Mapping[int, Trainer] | None = None) -> StrategyContext:
    ranks = list(range(1, workers + 1))
    pool = LocalPool({r: (trainers or {}).get(r) or Trainer(task()) for r in ranks})
    return StrategyContext(
        task=task(), aggregator=meshkit.plugins.create("aggregator", "fedavg"), pool=pool,
        workers=ranks, rng=np.random.default_rng(0), seed=3,
        outer=meshkit.plugins.create("outer_optimizer", "average"), timeout=30.0,
        compression=compression)


def seeds() -> dict[int, int]:
    return {c: 1000 + c for c in range(CLIENTS)}


def play(ctx: StrategyContext) -> tuple[Mapping[str, Any], Any]:
    state = ctx.task.init_state(3)
    return state, secure_sum(ctx, list(range(CLIENTS)), state=state, scheme=TABLE, rnd=1,
                             shards=CLIENTS, seeds=seeds())


def in_the_clear(state: Mapping[str, Any], clients: list[int], plan: CompressionPlan,
                 bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(the sum mod 2**bits of the clients' codes, the float64 sum of their clipped updates),
    computed in the clear from the same fits and seeds."""
    trainer = Trainer(task())
    trainer.handle({"op": "set_state", "seq": 1, "state": dict(state)})
    length = sum(state[k].size for k in vector_keys(state))
    codes, exact = np.zeros(length, vector_dtype(bits)), np.zeros(length)
    for client in clients:
        reply = trainer.handle({"op": "fit", "seq": 2, "shard": client, "shards": CLIENTS,
                                "seed": seeds()[client]})
        update = update_vector(reply["state"], state, vector_keys(state))
        add_mod(codes, field_codes(plan.compressor, update, seed=key_seed(seeds()[client], 0),
                                   clip_range=CLIP, dtype=vector_dtype(bits)), bits, out=codes)
        exact += np.clip(update, -CLIP, CLIP)
    return codes, exact


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_the_unmasked_sum_is_the_clients_codes_summed_in_a_field_of_b_plus_log2_n_bits(bits):
    plan = quantize(bits)
    ctx = context(3, plan)
    state, revealed = play(ctx)
    assert revealed.params.modulus_bits == bits + 4  # ceil(log2 10) = 4
    assert revealed.contributors == tuple(range(CLIENTS))
    codes, exact = in_the_clear(state, list(range(CLIENTS)), plan, bits + 4)
    np.testing.assert_array_equal(revealed.total, codes)  # bit for bit
    # Decoded once: each client's code is within one step of its clipped coordinate.
    step = 2 * CLIP / ((1 << bits) - 1)
    summed = np.concatenate([revealed.sum[k].ravel() for k in vector_keys(state)])
    assert np.abs(summed - exact).max() < CLIENTS * step
    assert np.abs(summed - exact).max() > 0  # it really went through the grid


def test_each_masked_reply_travels_packed_at_the_fields_width():
    workers = {r: Recording() for r in (1, 2, 3)}
    state, _ = play(context(3, quantize(8), workers))
    length = sum(state[k].size for k in vector_keys(state))
    for worker in workers.values():
        (reply,) = worker.masked
        # The update plus secagg+'s 2 check elements, 12 bits each (8 + ceil(log2 10)).
        assert reply["elements"] == length + 2
        assert reply["vector"].dtype == np.uint8
        assert reply["vector"].nbytes == packed_size(length + 2, 12) == \
            -(-(length + 2) * 12 // 8)
    # The same round uncompressed sends 32 bits an element.
    plain = {r: Recording() for r in (1, 2, 3)}
    play(context(3, None, plain))
    assert all(w.masked[0]["vector"].dtype == np.uint32 and "elements" not in w.masked[0]
               for w in plain.values())


def test_the_mean_of_an_int8_round_is_the_plain_secure_rounds_to_within_its_steps():
    state, compressed = play(context(3, quantize(8)))
    _, plain = play(context(3, None))
    step = 2 * CLIP / 255
    for key in vector_keys(state):
        # Both means are of the same clipped updates; int8 is off by under a step per
        # client, the 32-bit field by a negligible 2c / ((2^32 - 1) / 10).
        gap = np.abs(compressed.mean(state)[key].astype(np.float64)
                     - plain.mean(state)[key].astype(np.float64)).max()
        assert gap < step, (key, gap)


class Hostile(Trainer):
    """A worker whose packed masked vector is cut short, or whose spare bits are set."""

    def __init__(self, how: str) -> None:
        super().__init__(task())
        self.how = how

    def handle(self, request: Any) -> dict[str, Any]:
        reply = super().handle(request)
        if request.get("op") == "secagg_mask":
            vector = reply["vector"].copy()
            reply = ({**reply, "vector": vector[:-1]} if self.how == "short"
                     else {**reply, "elements": reply["elements"] - 1})
        return reply


@pytest.mark.parametrize("how", ["short", "count"])
def test_a_packed_vector_that_does_not_fit_the_field_drops_its_rank_and_the_round_goes_on(how):
    ctx = context(5, quantize(8), {2: Hostile(how)})
    state, revealed = play(ctx)
    assert "does not fit the field" in ctx.pool.dead[2]
    survivors = [c for c in range(CLIENTS) if c not in (1, 6)]  # rank 2 played 1 and 6
    assert revealed.contributors == tuple(survivors)
    codes, _ = in_the_clear(state, survivors, quantize(8), 12)
    np.testing.assert_array_equal(revealed.total, codes)
