"""A secure round over in-process workers: the exact sum, dropouts, refusals, breaches.

The workers are real :class:`~meshkit.train.Trainer` objects behind a
:class:`~meshkit.train.LocalPool` (every message crosses the wire encoding
and the schema boundary); ``tests/train/rounds/test_secure_round_processes.py`` plays
the same round over real worker processes.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import meshkit
import meshkit.plugins
from meshkit.secure_aggregation import choose
from meshkit_secagg import SecAggParams, add_mod, quantize, vector_dtype
from meshkit.train import LocalPool, StrategyContext, Trainer, round_params, secure_sum
from meshkit.train._worker.secure import update_vector, vector_keys


def secagg(**options: Any) -> Any:
    """The built-in ``secagg+`` scheme with these ``[secure_aggregation]`` options."""
    # interleave = false: these tests name the clients each rank plays, round-robin in
    # client order (test_secure_interleave.py covers the ring's placement).
    return choose("secagg+", {"interleave": False, **options})

CLIENTS = 10
# threshold 6: a strict majority of each client's 10 holders on the complete graph of 10
# clients (5 would let two halves of the survivors each unmask; docs/secure-aggregation.md).
TABLE = secagg(degree=0, threshold=6, clip_range=1.0)


def task() -> Any:
    return meshkit.plugins.create("task", "synthetic", {"params": 64, "arrays": 2, "rows": 80})


def context(workers: int, fail: Callable[[int, Mapping[str, Any]], str | None] | None = None,
            trainers: Mapping[int, Trainer] | None = None) -> StrategyContext:
    ranks = list(range(1, workers + 1))
    pool = LocalPool({r: (trainers or {}).get(r) or Trainer(task()) for r in ranks}, fail=fail)
    return StrategyContext(
        task=task(), aggregator=meshkit.plugins.create("aggregator", "fedavg"), pool=pool,
        workers=ranks, rng=np.random.default_rng(0), seed=3,
        outer=meshkit.plugins.create("outer_optimizer", "average"), timeout=30.0)


def seeds() -> dict[int, int]:
    return {c: 1000 + c for c in range(CLIENTS)}


def plaintext(state: Mapping[str, Any], clients: list[int], params: SecAggParams) -> np.ndarray:
    """The sum mod 2**bits of the same clients' quantised updates, computed in the clear."""
    trainer = Trainer(task())
    trainer.handle({"op": "set_state", "seq": 1, "state": dict(state)})
    total = np.zeros(sum(state[k].size for k in vector_keys(state)),
                     vector_dtype(params.modulus_bits))
    for client in clients:
        reply = trainer.handle({"op": "fit", "seq": 2, "shard": client, "shards": CLIENTS,
                                "seed": seeds()[client]})
        update = update_vector(reply["state"], state, vector_keys(state))
        add_mod(total, quantize(update, params), params.modulus_bits, out=total)
    return total


def play(ctx: StrategyContext, **kw: Any) -> Any:
    state = ctx.task.init_state(3)
    return state, secure_sum(ctx, list(range(CLIENTS)), state=state, scheme=kw.pop("scheme", TABLE),
                             rnd=1, shards=CLIENTS, seeds=seeds(), **kw)


def dies_at(op: str, ranks: set[int]) -> Callable[[int, Mapping[str, Any]], str | None]:
    """A worker of ``ranks`` is lost when it is sent ``op`` (its earlier replies stand)."""
    return lambda rank, request: (f"rank {rank} died" if rank in ranks and request["op"] == op
                                  else None)


@pytest.mark.parametrize("dropping", [0, 1, 3])  # 0 %, 10 %, 30 % of the cohort
def test_the_unmasked_sum_is_the_plaintext_fixed_point_sum_when_clients_drop_after_masking(
        dropping):
    gone = set(range(2, 2 + dropping))  # one client per worker: a rank is a client here
    ctx = context(CLIENTS, fail=dies_at("secagg_unmask", gone))
    state, revealed = play(ctx)
    # Their masked inputs arrived before they died: they are in the sum.
    assert revealed.contributors == tuple(range(CLIENTS)) and revealed.not_served == {}
    expected = plaintext(state, list(range(CLIENTS)), revealed.params)
    np.testing.assert_array_equal(revealed.total, expected)
    assert sorted(ctx.dead) == sorted(gone)
    mean = revealed.mean(state)
    for key in vector_keys(state):
        assert mean[key].dtype == state[key].dtype and not np.array_equal(mean[key], state[key])


def test_clients_dropping_before_masking_are_left_out_and_their_masks_cancelled():
    ctx = context(5, fail=dies_at("secagg_mask", {2}))  # rank 2 plays clients 1 and 6
    state, revealed = play(ctx)
    survivors = [c for c in range(CLIENTS) if c not in (1, 6)]
    assert revealed.contributors == tuple(survivors) and revealed.dropped == (1, 6)
    np.testing.assert_array_equal(revealed.total, plaintext(state, survivors, revealed.params))
    assert set(revealed.not_served) == {1, 6}
    assert revealed.not_served[1].startswith("dropped before sending its masked input: rank 2")


def test_fewer_survivors_than_the_threshold_is_refused_and_no_share_is_asked_for():
    ctx = context(5, fail=dies_at("secagg_mask", {1, 2, 3}))  # 6 of 10 drop; t = 6
    with pytest.raises(meshkit.RefusedError, match="fewer than the threshold 6: the round is "
                                                    "not unmasked"):
        play(ctx)
    assert not [q for _, q in ctx.pool.log if q["op"] == "secagg_unmask"]


def test_a_worker_plays_several_clients_and_sends_one_modular_sum():
    ctx = context(3)
    state, revealed = play(ctx)
    masked = [q for r, q in ctx.pool.log if q["op"] == "secagg_mask"]
    assert [q["clients"] for q in masked] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    np.testing.assert_array_equal(revealed.total,
                                  plaintext(state, list(range(CLIENTS)), revealed.params))


def test_a_workers_own_clients_expand_no_pairwise_mask_between_them(monkeypatch):
    # secagg+ declares the trait party: each worker's clients are built together and
    # told whom the reply sums, so a pair both in one reply expands no mask at either end.
    import meshkit_secagg._client as client_side

    expanded: list[int] = []
    real = client_side.mask_vector

    def counted(seed, length, bits, out=None):  # type: ignore[no-untyped-def]
        expanded.append(length)
        return real(seed, length, bits, out=out)

    monkeypatch.setattr(client_side, "mask_vector", counted)
    ctx = context(3)  # clients [0, 3, 6, 9], [1, 4, 7], [2, 5, 8]; the complete graph
    state, revealed = play(ctx)
    np.testing.assert_array_equal(revealed.total,
                                  plaintext(state, list(range(CLIENTS)), revealed.params))
    within = 2 * (6 + 3 + 3)  # both ends of each pair inside one worker
    assert len(expanded) == CLIENTS + CLIENTS * (CLIENTS - 1) - within


class Breaching(Trainer):
    """A worker whose reply to ``op`` is changed by ``breach``."""

    def __init__(self, op: str, breach: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        super().__init__(task())
        self.op, self.breach = op, breach

    def handle(self, request: Any) -> dict[str, Any]:
        reply = super().handle(request)
        return self.breach(reply) if request.get("op") == self.op else reply


def _same_keys(reply: dict[str, Any]) -> dict[str, Any]:
    adverts = reply["adverts"].copy()
    adverts[-1, :32] = adverts[0, :32]  # two of its clients advertise one share key
    return {**reply, "adverts": adverts}


def _bad_share(reply: dict[str, Any]) -> dict[str, Any]:
    shares = reply["shares"].copy()
    shares[:, 0] ^= 0xFF  # a share whose x is not the holder's
    return {**reply, "shares": shares}


@pytest.mark.parametrize("op, breach, reason", [
    ("secagg_keys", _same_keys, "advertises a public key client"),
    ("secagg_keys", lambda r: {**r, "clients": r["clients"][:-1],
                               "adverts": r["adverts"][:-1]}, "keys for clients"),
    ("secagg_share", lambda r: {**r, "senders": [r["senders"][0]] * len(r["senders"])},
     "recipients must be sorted"),
    ("secagg_mask", lambda r: {**r, "vector": r["vector"][:-1]}, "a masked input of"),
    ("secagg_mask", lambda r: {**r, "vector": r["vector"].astype(np.float32)},
     "expected a masked vector"),
    ("secagg_unmask", _bad_share, "share"),
])
def test_a_worker_sending_a_bad_key_share_or_vector_costs_only_its_own_rank(op, breach, reason):
    ctx = context(5, trainers={3: Breaching(op, breach)})
    state, revealed = play(ctx)
    assert list(ctx.dead) == [3] and ctx.dead[3].startswith("protocol error")
    assert reason in ctx.dead[3]
    # Rank 3 played clients 2 and 7: the others' sum is exact.
    if op == "secagg_unmask":  # masked already: in the sum, unmasked from the others' shares
        contributors = list(range(CLIENTS))
    else:
        contributors = [c for c in range(CLIENTS) if c not in (2, 7)]
    assert revealed.contributors == tuple(contributors)
    np.testing.assert_array_equal(revealed.total,
                                  plaintext(state, contributors, revealed.params))


def test_auto_degree_and_threshold_follow_the_cohort():
    small = round_params(secagg(), 10)
    assert (small.degree, small.threshold) == (6, 4)
    fraction = round_params(secagg(degree=0, threshold=0.5), 10)
    assert fraction.effective_degree == 9 and fraction.threshold == 5
    with pytest.raises(meshkit.ConfigError, match=r"threshold = 12: 12 shares are needed but "
                                                  r"each of this round's 10 clients has 9"):
        round_params(secagg(degree=0, threshold=12), 10)
    with pytest.raises(meshkit.RefusedError, match="with two each learns the other's"):
        round_params(secagg(), 2)
    with pytest.raises(meshkit.RefusedError, match="use modulus_bits >= 26"):
        round_params(secagg(modulus_bits=20), 1000)


def test_auto_degree_counts_workers_when_a_worker_plays_several_clients():
    # One client a worker: clients drop one by one, and 30 % of 100 dropping at random
    # needs 60 neighbours (29 of the other 99 gone must leave a majority of 61 holders).
    assert (round_params(secagg(), 100).degree, round_params(secagg(), 100).threshold) \
        == (60, 31)
    # 25 a worker over 4: what drops is a worker, any one of them, so 50 (25 of 51 holders
    # may go and 26 remain); 5 over 10 workers, 3 of them (15 clients): 30.
    assert (round_params(secagg(), 100, per_worker=25).degree,
            round_params(secagg(), 100, per_worker=25).threshold) == (50, 26)
    assert round_params(secagg(), 50, per_worker=5).degree == 30


@pytest.mark.parametrize("op", ["secagg_share", "secagg_open", "secagg_mask", "secagg_unmask"])
def test_the_auto_degree_survives_losing_any_one_worker_at_any_step(op):
    # 10 clients over 5 workers, 2 each: degree "auto" is 4, threshold 3 (6 and 4 before:
    # what 10 clients need when 30 % of them may drop at random). Losing rank 2 (clients 1
    # and 6) at any step leaves every client at least 3 of its 5 holders.
    scheme = secagg(clip_range=1.0)
    params = round_params(scheme, CLIENTS, per_worker=2)
    assert (params.degree, params.threshold) == (4, 3)
    ctx = context(5, fail=dies_at(op, {2}))
    state, revealed = play(ctx, scheme=scheme)
    gone = () if op == "secagg_unmask" else (1, 6)
    contributors = [c for c in range(CLIENTS) if c not in gone]
    assert revealed.contributors == tuple(contributors)
    np.testing.assert_array_equal(revealed.total,
                                  plaintext(state, contributors, revealed.params))


#: Reply fields a breaching worker may garble: every list and row array, but only the shape
#: of the masked vector and the order of the adverts, not their contents (any input, or any
#: key, a client may choose: secure aggregation keeps the sum secret; it does not check what
#: a client adds to it).
GARBLED = {"secagg_keys": ("clients", "adverts"), "secagg_share": ("senders", "recipients",
                                                                   "sealed"),
           "secagg_open": ("senders", "recipients"),
           "secagg_mask": ("clients", "vector"),
           "secagg_unmask": ("holders", "owners", "kinds", "shares")}


def garble(reply: dict[str, Any], field: str, how: str, at: int) -> dict[str, Any]:
    value = reply[field]
    if not len(value):
        return reply
    i = at % len(value)
    if how == "drop":
        value = value[:i] + value[i + 1:] if isinstance(value, list) else np.delete(value, i, 0)
    elif how == "repeat":
        value = (value + [value[i]]) if isinstance(value, list) else np.concatenate(
            [value, value[i:i + 1]])
    elif how == "swap":
        value = list(value) if isinstance(value, list) else value.copy()
        value[0], value[i] = (value[i], value[0]) if isinstance(value, list) else (
            value[i].copy(), value[0].copy())
    elif how == "bump" and isinstance(value, list):
        value = [*value[:i], value[i] + 1, *value[i + 1:]]
    elif how == "flip" and field in ("sealed", "shares"):
        value = value.copy()
        value[i, at % value.shape[1]] ^= 0x5A
    elif how == "narrow":
        value = value[:-1] if isinstance(value, list) or value.ndim == 1 else value[:, :-1]
    return {**reply, field: value}


@settings(max_examples=12, deadline=None)
@given(st.sampled_from(sorted(GARBLED)), st.data())
def test_any_garbled_secure_reply_is_its_ranks_fault_or_a_clean_refusal(op, data):
    field = data.draw(st.sampled_from(GARBLED[op]))
    if field == "vector":
        hows = ["drop", "repeat", "narrow"]
    else:  # a masked sum listed under the wrong clients fails its count check: refused
        hows = ["drop", "repeat", "swap", "bump", "flip", "narrow"]
    how = data.draw(st.sampled_from(hows))
    at = data.draw(st.integers(0, 50))
    ctx = context(5, trainers={3: Breaching(op, lambda r: garble(r, field, how, at))})
    try:
        state, revealed = play(ctx)
    except meshkit.MeshError:
        return  # a refusal or a worker's error, each saying why: never another exception
    assert set(ctx.dead) <= {3}
    if ctx.dead:
        assert ctx.dead[3].startswith("protocol error")
    # Whatever was taken in, the sum unmasked is the exact sum of who is in it.
    np.testing.assert_array_equal(revealed.total,
                                  plaintext(state, list(revealed.contributors), revealed.params))


def _garbage(rows: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A share reply whose first sealed row, or every one, is garbage."""
    def tamper(reply: dict[str, Any]) -> dict[str, Any]:
        sealed = reply["sealed"].copy()
        if rows == "one":
            sealed[0, -1] ^= 1  # client 2's share for its first neighbour, client 0
        else:
            sealed[:, 32:] = np.random.default_rng(5).integers(0, 256, sealed[:, 32:].shape)
        return {**reply, "sealed": sealed}
    return tamper


@pytest.mark.parametrize("rows", ["one", "every"])
def test_garbage_sealed_shares_cost_their_sealer_never_the_accuser(rows):
    ctx = context(5, trainers={3: Breaching("secagg_share", _garbage(rows))})
    state, revealed = play(ctx)
    # The accusers' word is not taken: rank 3 revealed its ephemeral keys, and the shares it
    # sealed do not open under them. Rank 3 (clients 2 and 7) is out; every accuser masks.
    assert list(ctx.dead) == [3]
    assert "client 2's shares for client 0 do not open under the key it revealed" in ctx.dead[3]
    others = [c for c in range(CLIENTS) if c not in (2, 7)]
    assert revealed.contributors == tuple(others) and set(revealed.not_served) == {2, 7}
    assert revealed.not_served[2].startswith("dropped before masking: rank 3 was lost "
                                             "(protocol error: client 2's shares")
    np.testing.assert_array_equal(revealed.total, plaintext(state, others, revealed.params))


def test_a_false_accusation_costs_the_accuser_never_the_accused():
    def accuse(reply: dict[str, Any]) -> dict[str, Any]:
        # Rank 3's client 2 says client 0's (sound) shares did not open.
        return {**reply, "senders": [0], "recipients": [2]}

    ctx = context(5, trainers={3: Breaching("secagg_open", accuse)})
    state, revealed = play(ctx)
    assert list(ctx.dead) == [3]
    assert "client 2 accused client 0 of shares that do open" in ctx.dead[3]
    others = [c for c in range(CLIENTS) if c not in (2, 7)]
    assert revealed.contributors == tuple(others)
    np.testing.assert_array_equal(revealed.total, plaintext(state, others, revealed.params))


class Failing(Trainer):
    """A worker whose task raises on ``op``: it answers with an ``error`` reply."""

    def __init__(self, op: str) -> None:
        super().__init__(task())
        self.op = op

    def handle(self, request: Any) -> dict[str, Any]:
        if request.get("op") == self.op:
            return {"error": f"{self.op}: RuntimeError: broken on purpose",
                    "seq": request["seq"]}
        return super().handle(request)


@pytest.mark.parametrize("op", ["secagg_keys", "secagg_share", "secagg_mask", "secagg_unmask"])
def test_an_error_reply_costs_its_rank_the_round_and_is_named_with_the_reason(op):
    ctx = context(5, trainers={3: Failing(op)})
    state, revealed = play(ctx)
    # Rank 3 (clients 2 and 7) is not declared dead: it plays again next round.
    assert ctx.dead == {}
    if op == "secagg_unmask":  # masked already: in the sum, unmasked from the others' shares
        contributors = list(range(CLIENTS))
    else:
        contributors = [c for c in range(CLIENTS) if c not in (2, 7)]
        assert set(revealed.not_served) == {2, 7}
        assert f"rank 3 failed: {op}: RuntimeError: broken on purpose" in \
            revealed.not_served[2]
    assert revealed.contributors == tuple(contributors)
    np.testing.assert_array_equal(revealed.total,
                                  plaintext(state, contributors, revealed.params))


def test_with_accept_failures_false_an_error_reply_ends_the_run():
    ctx = context(5, trainers={3: Failing("secagg_mask")})
    with pytest.raises(meshkit.WorkerError, match="broken on purpose"):
        play(ctx, accept_failures=False)


def _lie_about(owner: int) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """Every share of ``owner``'s self-mask seed in a reply altered (off the polynomial)."""
    def breach(reply: dict[str, Any]) -> dict[str, Any]:
        shares = reply["shares"].copy()
        for i, (o, k) in enumerate(zip(reply["owners"], reply["kinds"])):
            if o == owner and k == 0:
                shares[i, -1] ^= 1
        return {**reply, "shares": shares}
    return breach


def test_bad_unmasking_shares_from_a_rank_playing_two_clients_cost_that_rank_only():
    # Rank 3 plays clients 2 and 7; both lie about client 4's seed. Leaving out one holder
    # at a time cannot find them; leaving out rank 3 (both its clients) does.
    ctx = context(5, trainers={3: Breaching("secagg_unmask", _lie_about(4))})
    state, revealed = play(ctx)
    assert list(ctx.dead) == [3] and "held by clients [2, 7] (played by party 3)" in ctx.dead[3]
    assert revealed.contributors == tuple(range(CLIENTS))  # its inputs were masked already
    np.testing.assert_array_equal(revealed.total,
                                  plaintext(state, list(range(CLIENTS)), revealed.params))


class _Buffered:
    """The synthetic task with what ``meshkit.torch`` adds for a BatchNorm layer in a
    bfloat16 model: a bfloat16 parameter and ``num_batches_tracked`` as a float64 count
    listed in the state's ``INT_BUFFERS`` leaf, which each fit advances by 16 batches."""

    def __init__(self) -> None:
        self.inner = task()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def init_state(self, seed: int) -> dict[str, Any]:
        from meshkit.state import BFLOAT16, INT_BUFFERS

        return {**self.inner.init_state(seed), "h": np.full(6, 0.25, BFLOAT16),
                "bn.num_batches_tracked": np.array(100.0),
                INT_BUFFERS: {"bn.num_batches_tracked": "int64"}}

    def fit(self, state: Mapping[str, Any], x: np.ndarray, y: np.ndarray, *, seed: int) -> Any:
        from meshkit.state import BFLOAT16, INT_BUFFERS

        result = self.inner.fit(state, x, y, seed=seed)
        result.state.update({"h": (np.asarray(state["h"], np.float32) + 0.5).astype(BFLOAT16),
                             "bn.num_batches_tracked": state["bn.num_batches_tracked"] + 16.0,
                             INT_BUFFERS: state[INT_BUFFERS]})
        return result


def test_a_bfloat16_parameter_is_summed_and_a_float_carried_count_keeps_the_global_value():
    # Before: vector_keys asked np.floating, which bfloat16 is not (its parameters kept the
    # global value: frozen, silently), and summed the float64 count as an update under the
    # clip (it gained at most clip_range a round, not the 16 batches a fit saw).
    ranks = list(range(1, 6))
    ctx = StrategyContext(
        task=_Buffered(), aggregator=meshkit.plugins.create("aggregator", "fedavg"),
        pool=LocalPool({r: Trainer(_Buffered()) for r in ranks}), workers=ranks,
        rng=np.random.default_rng(0), seed=3,
        outer=meshkit.plugins.create("outer_optimizer", "average"), timeout=30.0)
    state, revealed = play(ctx)
    assert "h" in revealed.sum and "bn.num_batches_tracked" not in revealed.sum
    mean = revealed.mean(state)
    # Every client moved h by 0.5, exactly representable in bfloat16 and on the grid.
    np.testing.assert_array_equal(mean["h"].astype(np.float32), np.full(6, 0.75, np.float32))
    assert mean["h"].dtype == state["h"].dtype
    assert mean["bn.num_batches_tracked"] == 100.0  # the global model's count, unclipped
