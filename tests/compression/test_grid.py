"""``[compression] clip_range``: clients' codes on one shared grid, summed exactly as integers.

* a worker answers a batch with one integer sum (``grid``), never a payload a client, and
  the coordinator's model is the bits of adding each client's codes one at a time
  (the per-client fold), whichever worker summed which clients in whatever order;
* a sum that does not fit (a lie about its weights, a code sum no batch could reach)
  costs its rank, its clients are served elsewhere, and the bits do not move;
* what cannot be an integer sum is refused, naming what it would need.
"""

from __future__ import annotations

import numpy as np
import pytest

import meshkit.plugins
from meshkit.compression import CodeSum, CompressionPlan, check_compression, grid_codes
from meshkit.errors import ProtocolError, RefusedError
from meshkit.secure_aggregation import SecureAggregationTraits
from meshkit.train import Trainer, fold_round

from tests.support.rounds import fits, make_ctx, same_bytes, synthetic

CLIP = 0.5


def plan(name: str = "quantize", options: dict | None = None,
         clip_range: float | None = CLIP) -> CompressionPlan:
    options = {"bits": 8} if options is None else options
    return CompressionPlan(name, options, meshkit.plugins.create("compression", name, options),
                           clip_range=clip_range)


def per_client(state: dict, clients: int, chosen: CompressionPlan) -> tuple[dict, list[int]]:
    """The round folded at the coordinator one client at a time: each fit's codes on the
    grid added with its examples (the per-client fold path)."""
    total = CodeSum(chosen.compressor, state, clip_range=CLIP)
    examples = []
    for key, work in enumerate(fits(clients)):
        trainer = Trainer(synthetic())
        trainer.handle({"op": "set_state", "state": state})
        reply = trainer.handle(work.request)
        codes = grid_codes(chosen.compressor, state, reply["state"], seed=work.request["seed"],
                           clip_range=CLIP, keys=total.keys)
        total.add(codes, reply["examples"], whole={k: reply["state"][k]
                                                   for k in total.whole_keys},
                  source=f"client {key}")
        examples.append(int(reply["examples"]))
    return total.result(), examples


def test_each_batch_answers_with_one_sum_and_the_model_is_the_per_client_folds_bits():
    chosen = plan()
    state = make_ctx().task.init_state(0)
    expected, examples = per_client(state, 9, chosen)
    assert len(set(examples)) > 1  # the weights are not all equal: weighing is exercised
    for workers, shuffle in ((1, None), (2, 5), (3, 6)):
        ctx = make_ctx(workers=workers, order=None if shuffle is None
                       else np.random.default_rng(shuffle))
        ctx.compression = chosen
        folded = fold_round(ctx, fits(9), state=state)
        asked = [r for _, r in ctx.pool.log if r.get("op") == "fit_batch"]
        assert "take_partial" in {r.get("op") for _, r in ctx.pool.log}
        assert asked and all(r["compress"]["clip_range"] == CLIP and r["weight"] == "examples"
                             for r in asked)
        assert sorted(folded.served) == list(range(9)) and folded.failed == {}
        assert same_bytes(folded.result, expected), (workers, shuffle)
    # The grid is coarse but unbiased: the mean is near the uncompressed round's.
    plain = fold_round(make_ctx(workers=2), fits(9), state=state).result
    for key, value in plain.items():
        if isinstance(value, np.ndarray) and value.dtype.kind == "f":
            np.testing.assert_allclose(expected[key], value, atol=2 * CLIP / 255)


def test_a_worker_hands_over_one_sum_for_all_its_batches_not_a_payload_a_client():
    ctx = make_ctx(workers=2)
    ctx.compression = plan()
    state = ctx.task.init_state(0)
    answers = []

    class Recording(Trainer):
        def handle(self, request):
            reply = super().handle(request)
            if request.get("op") in ("fit_batch", "take_partial"):
                answers.append((request["op"], len(request.get("fits", ())), reply))
            return reply

    ctx.pool.trainers[1] = Recording(synthetic())
    folded = fold_round(ctx, fits(100, shards=100), state=state)
    batches = [(n, reply) for op, n, reply in answers if op == "fit_batch"]
    sums = [reply["partial"] for op, _, reply in answers if op == "take_partial"]
    assert len(batches) >= 2 and len(sums) == 1  # several batches, one sum pulled
    assert all("payloads" not in reply for _, reply in batches)
    grid = sums[0]
    assert grid["count"] == sum(n for n, _ in batches)
    assert grid["count"] == sum(1 for rank in folded.served.values() if rank == 1)
    # bits + ceil(log2 mass) a coordinate, however many clients it sums.
    bits = grid["bits"]
    assert bits == (grid["mass"] * 255).bit_length() < 32
    for k in (k for k in grid if k.startswith("sum/")):
        assert grid[k].dtype == np.uint8
        assert grid[k].size == -(-np.asarray(state[k[4:]]).size * bits // 8)


class Lying(Trainer):
    def __init__(self, task, how):
        super().__init__(task)
        self.how = how

    def handle(self, request):
        reply = super().handle(request)
        if request.get("op") == "take_partial" and "bits" in reply.get("partial", {}):
            grid = dict(reply["partial"])
            if self.how == "mass":
                grid["mass"] += 1
            else:  # a sum beyond what its codes can reach: every bit set
                key = next(k for k in grid if k.startswith("sum/"))
                grid[key] = np.full_like(grid[key], 0xFF)
            reply["partial"] = grid
        return reply


@pytest.mark.parametrize("how, words", [("mass", "weighing"), ("sum", "sums to more")])
def test_a_sum_that_does_not_fit_costs_its_rank_and_the_bits_stay(how, words):
    chosen = plan()
    state = make_ctx().task.init_state(0)
    expected, _ = per_client(state, 8, chosen)
    ctx = make_ctx(workers=2)
    ctx.compression = chosen
    ctx.pool.trainers[2] = Lying(synthetic(), how)
    folded = fold_round(ctx, fits(8), state=state)
    assert list(ctx.dead) == [2] and ctx.dead[2].startswith("protocol error")
    assert words in ctx.dead[2], ctx.dead[2]
    assert sorted(folded.served) == list(range(8)) and set(folded.served.values()) == {1}
    assert same_bytes(folded.result, expected)


def test_a_weight_that_is_not_a_whole_number_is_refused_saying_what_it_needs():
    chosen = plan()
    state = make_ctx().task.init_state(0)
    total = CodeSum(chosen.compressor, state, clip_range=CLIP)
    codes = {k: np.zeros(np.asarray(state[k]).size, np.int64) for k in total.keys}
    with pytest.raises(RefusedError, match="not a whole number.*per-client round"):
        total.add(codes, 2.5, whole={k: state[k] for k in total.whole_keys}, source="c")
    assert total.count == 0 and total.mass == 0
    with pytest.raises(ProtocolError, match="outside"):
        total.add({k: v + 256 for k, v in codes.items()}, 1,
                  whole={k: state[k] for k in total.whole_keys}, source="c")


def test_merging_worker_sums_is_adding_their_clients_codes():
    chosen = plan(options={"bits": 4})
    rng = np.random.default_rng(3)
    state = {"w": rng.standard_normal(1000).astype(np.float32), "n": np.array([3])}
    fitted = [{"w": state["w"] + rng.normal(0, 0.1, 1000).astype(np.float32),
               "n": np.array([3])} for _ in range(5)]
    weights = [3, 1, 4, 1, 5]
    one = CodeSum(chosen.compressor, state, clip_range=CLIP)
    for i, (f, w) in enumerate(zip(fitted, weights)):
        one.add_fit(state, f, w, seed=i, source=str(i))
    merged = CodeSum(chosen.compressor, state, clip_range=CLIP)
    for part in ((0, 1), (2,), (3, 4)):
        worker = CodeSum(chosen.compressor, state, clip_range=CLIP)
        for i in part:
            worker.add_fit(state, fitted[i], weights[i], seed=i, source=str(i))
        merged.merge(worker.to_wire(), source=f"worker {part}")
    assert merged.count == 5 and merged.mass == sum(weights)
    result = merged.result()
    assert same_bytes(result, one.result())
    # Unbiased within the grid: the decoded mean is near the weighted mean of the updates.
    mean = sum(w * f["w"].astype(np.float64) for f, w in zip(fitted, weights)) / sum(weights)
    np.testing.assert_allclose(result["w"], mean, atol=2 * CLIP / 15)


@pytest.mark.parametrize("name, options, secure, words", [
    ("top-k", {"fraction": 0.1}, None, "not sparse"),
    ("quantize", {"bits": 8, "rotate": True}, None, "integer_field"),
    ("quantize", {"bits": 8}, SecureAggregationTraits(modulus_bits=16, advert_size=64, sealed_size=64, share_size=64, reveal_size=64, integer_inputs=True),
     "[secure_aggregation] clip_range"),
])
def test_what_cannot_be_summed_on_one_grid_is_refused_naming_the_trait(name, options, secure,
                                                                        words):
    with pytest.raises(RefusedError) as info:
        check_compression(plan(name, options), where="run.toml", private_client_clip=False,
                          secure=secure)
    assert "clip_range" in str(info.value) and words in str(info.value)


def test_a_round_the_grid_cannot_apply_to_says_so_once_and_plays_per_client(caplog):
    """One fit a worker is no batched round: each client uploads its own payload, and the
    run warns (once) that ``clip_range`` was not used, rather than ignoring it silently."""
    chosen = plan()
    ctx = make_ctx(workers=3)
    ctx.compression = chosen
    state = ctx.task.init_state(0)
    with caplog.at_level("WARNING", logger="meshkit.train._rounds.compressed"):
        for _ in range(2):
            folded = fold_round(ctx, fits(3), state=state)
            assert sorted(folded.served) == [0, 1, 2]
    ops = {r.get("op") for _, r in ctx.pool.log}
    assert "fit_batch" not in ops and "take_partial" not in ops
    said = [r for r in caplog.records if "clip_range" in r.getMessage()]
    assert len(said) == 1 and "each client uploads its payload on its own grid" in \
        said[0].getMessage()
    # Once a run, not once a process: a second run with the same plan (a long-lived
    # `meshkit serve` plays many) is told again.
    again = make_ctx(workers=3)
    again.compression = chosen
    with caplog.at_level("WARNING", logger="meshkit.train._rounds.compressed"):
        fold_round(again, fits(3), state=state)
    said = [r for r in caplog.records if "clip_range" in r.getMessage()]
    assert len(said) == 2
