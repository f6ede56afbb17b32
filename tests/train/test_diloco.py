"""``diloco``: inner steps, the exact mean of the replicas' pseudo-gradients, one outer update
applied to the same bits everywhere, fragments streamed, replicas dropped and healed
(in-process through LocalPool; the processes' version is test_diloco_processes.py)."""

from __future__ import annotations

import numpy as np
import pytest

import meshkit
from meshkit.aggregation import BLOCK, decode_blocks, encode_blocks
from meshkit.train import LocalPool, Trainer, client_seed, split_fragments, state_digest

from tests.train.test_strategies import JoinsLate, make_ctx


def digits() -> object:
    return meshkit.plugins.create("task", "digits")


def run(ranks=(1, 2), *, outer="nesterov", outer_options=None, pool=None, task=None,
        **options):
    task = task or digits()
    ctx = make_ctx(task, ranks=ranks, pool=pool,
                   outer=meshkit.plugins.create("outer_optimizer", outer, outer_options))
    if pool is None:
        ctx.pool = LocalPool.of(lambda: task, ranks)
    rows = []
    ctx.on_round = lambda report, state: rows.append(report)
    options = {"rounds": 2, "inner_steps": 4, "batch_size": 16, **options}
    result = meshkit.plugins.create("strategy", "diloco", options).run(ctx)
    return result, rows, ctx


def same_bits(a, b) -> bool:
    return state_digest(a) == state_digest(b)


# -- the codes ----------------------------------------------------------------------------


@pytest.mark.parametrize("bits, levels", [(8, 127), (4, 7)])
def test_blockwise_codes_are_within_half_a_step_of_each_value(bits, levels):
    x = np.random.default_rng(0).normal(size=3 * BLOCK + 5).astype(np.float32)
    x[BLOCK:2 * BLOCK] = 0.0  # a block of zeros decodes to zeros
    codes, scales = encode_blocks(x, bits)
    assert codes.nbytes == (x.size if bits == 8 else (x.size + 1) // 2)
    back = decode_blocks(codes, scales, x.size, bits)
    assert back.dtype == np.float32
    step = np.repeat(scales, BLOCK)[:x.size]
    assert np.all(np.abs(back - x) <= step / 2 + 1e-7)
    assert np.all(back[BLOCK:2 * BLOCK] == 0.0)
    assert np.abs(x).max() / levels == pytest.approx(float(scales.max()))


def test_32_bit_codes_are_the_float32_values_themselves():
    x = np.linspace(-1, 1, 7, dtype=np.float64)
    codes, scales = encode_blocks(x, 32)
    assert scales.size == 0
    assert decode_blocks(codes, scales, 7, 32).tobytes() == x.astype(np.float32).tobytes()


@pytest.mark.parametrize("codes, scales, why", [
    (np.zeros(9, np.int8), np.ones(1, np.float32), r"codes must be int8\[10\]"),
    (np.zeros(10, np.int16), np.ones(1, np.float32), r"codes must be int8\[10\]"),
    (np.zeros(10, np.int8), np.ones(2, np.float32), r"scales must be float32\[1\]"),
    (np.zeros(10, np.int8), np.array([np.nan], np.float32), "NaN or inf"),
    (np.full(10, -128, np.int8), np.ones(1, np.float32), r"outside \[-127, 127\]"),
])
def test_a_code_that_does_not_fit_is_the_senders_protocol_error(codes, scales, why):
    with pytest.raises(meshkit.ProtocolError, match=why):
        decode_blocks(codes, scales, 10, 8, what="rank 2's pseudo-gradient")


def test_fragments_cover_every_float_array_once_in_state_order():
    state = {"a": np.zeros(100), "n": np.zeros(3, np.int64), "b": np.zeros(10),
             "c": np.zeros(90), "d": np.zeros(5)}
    groups = split_fragments(state, 2)
    assert groups == [["a"], ["b", "c", "d"]]
    assert [k for g in split_fragments(state, 4) for k in g] == ["a", "b", "c", "d"]
    with pytest.raises(ValueError, match="at most 4 fragments"):
        split_fragments(state, 5)


# -- the outer step --------------------------------------------------------------------


def test_an_outer_step_is_the_mean_of_the_replicas_inner_steps_with_nesterov_lr_1_mu_0():
    # lr 1, momentum 0: x <- x - mean(x - local_i) = mean(local_i), at float32 precision.
    task = digits()
    result, rows, ctx = run(rounds=1, outer_options={"lr": 1.0, "momentum": 0.0})
    start = task.init_state(ctx.seed)
    x, y = task.train_data()
    locals_ = []
    for shard in (0, 1):
        trainer = Trainer(digits())
        state = {k: np.array(v) for k, v in start.items()}
        for step in range(4):
            bx, by = trainer._seeded_batch(shard, 2, 16, client_seed(ctx.seed, step, shard))
            state = dict(task.apply(state, task.gradients(state, bx, by).state))
        locals_.append(state)
    for key in start:
        expected = (np.asarray(locals_[0][key], np.float32)
                    + np.asarray(locals_[1][key], np.float32)) / 2
        np.testing.assert_allclose(np.asarray(result.state[key], np.float32), expected,
                                   rtol=1e-5, atol=1e-6)
    assert rows[0].metrics["inner_steps"] == 4 and rows[0].answered == (1, 2)


def test_the_replicas_anchor_is_the_coordinators_global_model_bit_for_bit():
    result, rows, ctx = run(rounds=3, outer_bits=8)
    # Each round's replies carry the anchor with the last round's update applied.
    for before, after in zip(rows, rows[1:]):
        assert after.metrics["digest_rank1"] == before.metrics["model_digest"]
        assert after.metrics["digest_rank2"] == before.metrics["model_digest"]
    anchor = ctx.pool.trainers[1].replica.anchor
    rows_state = dict(result.state)
    # The last update is still pending on the replicas: apply it the way they will.
    assert set(anchor) == set(rows_state)
    assert rows[-1].metrics["loss"] < rows[0].metrics["loss"]


@pytest.mark.parametrize("ranks", [(1, 2), (1, 2, 3, 4)], ids=["2 replicas", "4 replicas"])
@pytest.mark.parametrize("fragments, bits", [(1, 32), (2, 4)])
def test_the_same_seed_gives_the_same_model_bits_whatever_order_replies_arrive_in(
        ranks, fragments, bits):
    first, _, _ = run(ranks, fragments=fragments, outer_bits=bits)
    task = digits()
    shuffled = LocalPool.of(lambda: task, ranks, order=np.random.default_rng(5))
    second, _, _ = run(ranks, pool=shuffled, task=task, fragments=fragments, outer_bits=bits)
    assert same_bits(first.state, second.state)


def test_streaming_fragments_divide_the_peak_bytes_of_an_exchange():
    _, whole, _ = run(rounds=2, inner_steps=4, outer_bits=8)
    _, streamed, _ = run(rounds=2, inner_steps=4, fragments=2, outer_bits=8)
    state = digits().init_state(0)

    def exchanged(keys):  # up and down, two replicas: an int8 a value, a float32 a block
        return 2 * 2 * sum(v.size + 4 * -(-v.size // BLOCK) for k, v in state.items()
                           if k in keys)

    plain, peak = whole[-1].metrics, streamed[-1].metrics
    fragments = split_fragments(state, 2)
    assert plain["peak_exchange_bytes"] == exchanged(set(state))
    assert peak["peak_exchange_bytes"] == max(exchanged(set(f)) for f in fragments)
    assert peak["peak_exchange_bytes"] < plain["peak_exchange_bytes"]
    # The same bytes move in all; only the peak is split.
    assert peak["bytes_up"] == plain["bytes_up"] == plain["payload_up"]
    assert streamed[-1].metrics["loss"] < streamed[0].metrics["loss"]


def test_eight_and_four_bit_exchanges_cost_a_quarter_and_an_eighth_of_float32s():
    sizes = {bits: run(rounds=1, outer_bits=bits)[1][0].metrics["bytes_up"]
             for bits in (32, 8, 4)}
    assert sizes[8] / sizes[32] == pytest.approx(0.25, rel=0.03)
    assert sizes[4] / sizes[32] == pytest.approx(0.125, rel=0.05)


# -- failures ------------------------------------------------------------------------


def test_a_replica_lost_mid_exchange_is_left_out_of_that_step_and_the_others_finish():
    task = digits()
    inner = {"n": 0}

    def fail(rank, request):
        if request["op"] == "inner":
            inner["n"] += 1
            if rank == 2 and inner["n"] >= 4:  # round 2's exchange
                return "connection reset (killed)"
        return None

    pool = LocalPool.of(lambda: task, (1, 2, 3), fail=fail)
    result, rows, ctx = run((1, 2, 3), pool=pool, task=task, rounds=3, quorum=2)
    assert rows[0].answered == (1, 2, 3)
    assert rows[1].answered == (1, 3) and rows[1].dropped == (2,)
    assert rows[2].answered == (1, 3)
    assert rows[2].metrics["digest_rank1"] == rows[2].metrics["digest_rank3"]


def test_fewer_pseudo_gradients_than_the_quorum_stop_the_run_naming_it():
    task = digits()
    pool = LocalPool.of(lambda: task, (1, 2), fail=lambda rank, request: (
        "killed" if rank == 2 and request["op"] == "inner" else None))
    with pytest.raises(meshkit.PeerLostError, match=r"fewer than \[strategy\] quorum = 2"):
        run(pool=pool, task=task, quorum=2)


def test_a_rank_that_comes_up_late_is_healed_from_a_live_replica_and_agrees_by_digest():
    task = digits()
    pool = JoinsLate({r: Trainer(task) for r in (1, 2, 3)})
    pool.after = 3  # rank 3 is live from the second round on
    result, rows, ctx = run((1, 2, 3), pool=pool, task=task, rounds=3, fragments=2)
    assert rows[0].answered == (1, 2)
    assert rows[1].answered == (1, 2, 3) and rows[1].metrics["healed"] == 1
    assert [req["op"] for rank, req in pool.log if rank == 3][0] == "replica_put"
    for row in rows[1:]:
        assert row.metrics["digest_rank3"] == row.metrics["digest_rank1"]
    assert rows[2].metrics["healed"] == 0


def test_a_healed_torch_replica_continues_bit_for_bit_with_its_inner_optimizer_state():
    torch = pytest.importorskip("torch")
    from torch.utils.data import TensorDataset

    from meshkit.torch import TorchTask

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 5, generator=gen), torch.randint(0, 3, (64,), generator=gen)

    def make():
        return TorchTask(model=lambda: torch.nn.Linear(5, 3), loss=torch.nn.CrossEntropyLoss(),
                         data=lambda: (TensorDataset(x, y), TensorDataset(x, y)),
                         optimizer=lambda p: torch.optim.AdamW(p, lr=0.05))

    donor, late, alone = Trainer(make()), Trainer(make()), Trainer(make())
    state = make().init_state(0)
    inner = {"op": "inner", "steps": 3, "shard": 0, "shards": 1, "batch_size": 8, "seed": 1,
             "step": 0, "send": 0}
    for trainer in (donor, alone):
        trainer.handle({"op": "replica_init", "state": state, "fragments": 1, "bits": 8})
        assert "error" not in trainer.handle(inner)
    handed = donor.handle({"op": "replica_get"})
    assert any(k.endswith("exp_avg_sq") for k in handed["optimizer"])
    put = late.handle({"op": "replica_put", **{k: handed[k] for k in (
        "anchor", "local", "optimizer", "snapshot", "pending", "inner_steps")},
        "fragments": 1, "bits": 8})
    assert put["replica_digest"] == handed["replica_digest"]
    nxt = {**inner, "step": 3, "send": None}
    nxt.pop("send")
    a, b = late.handle(nxt), alone.handle(nxt)
    assert a["digest"] == b["digest"]
    assert same_bits(late.replica.local, alone.replica.local)


# -- refusals --------------------------------------------------------------------------


def check(**options) -> None:
    strategy = meshkit.plugins.create("strategy", "diloco", options)
    strategy.traits.check(task=digits(), outer_name="nesterov", workers=4,
                          aggregator=meshkit.plugins.create("aggregator", "median"))


def test_inner_steps_that_fragments_do_not_divide_are_refused_naming_both():
    with pytest.raises(meshkit.ConfigError, match="inner_steps = 10 is not a multiple of "
                                                  "fragments = 4"):
        meshkit.plugins.create("strategy", "diloco", {"inner_steps": 10, "fragments": 4}
                               ).check(task=digits(), outer_name="nesterov", workers=4)


def test_a_quorum_above_the_workers_is_refused():
    with pytest.raises(meshkit.ConfigError, match="quorum = 5 but there are only 4 workers"):
        meshkit.plugins.create("strategy", "diloco", {"quorum": 5}).check(
            task=digits(), outer_name="nesterov", workers=4)


def test_an_aggregator_that_is_not_linear_is_refused_naming_the_trait():
    with pytest.raises(meshkit.RefusedError, match="AggregatorTraits.linear"):
        check()


def test_outer_bits_other_than_32_8_4_are_a_config_error():
    with pytest.raises(Exception, match="outer_bits"):
        meshkit.plugins.create("strategy", "diloco", {"outer_bits": 16})
