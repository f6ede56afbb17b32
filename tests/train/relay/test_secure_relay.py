"""A secure round behind host relays, in-process: each relay adds its ranks' masked vectors.

The relays are the kernel's relay side (``answer_relay_request``, what ``meshkit relay``
runs) over in-process workers; the requests cross the wire encoding both ways.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import pytest

import meshkit
import meshkit.plugins
from meshkit.secure_aggregation import choose
from meshkit.compression import CompressionPlan, field_codes, key_seed
from meshkit_secagg import add_mod, quantize, vector_dtype
from meshkit.train import LocalPool, Reply, StrategyContext, Trainer, answer_relay_request
from meshkit.train import decode, encode, secure_sum
from meshkit.train._relay.secure import masked_sum_request, serve_masked_sum
from meshkit.train._worker.secure import update_vector, vector_keys


def secagg(**options: Any) -> Any:
    """The built-in ``secagg+`` scheme with these ``[secure_aggregation]`` options."""
    # interleave = false: these tests name the clients each rank plays, round-robin in
    # client order (test_secure_interleave.py covers the ring's placement).
    return choose("secagg+", {"interleave": False, **options})

CLIENTS = 10
LAYOUT = {"hostA": [1, 2], "hostB": [3, 4]}  # and rank 5 dialed the coordinator directly


def task() -> Any:
    return meshkit.plugins.create("task", "synthetic", {"params": 64, "arrays": 2, "rows": 80})


class Relayed:
    """Rank 0's pool: ranks behind two in-process relays, one direct rank."""

    def __init__(self, fail: Any = None) -> None:
        self.trainers = {r: Trainer(task()) for r in range(1, 6)}
        self.direct = LocalPool(self.trainers)
        self.fail = fail
        self.asked: list[tuple[str, dict[str, Any]]] = []
        self._answers: list[Reply] = []
        self.answered: list[dict[str, Any]] = []  # each relay's answer, as it went up
        self._seq = 10 ** 6

    relays = property(lambda self: {n: self.direct.live(rs) for n, rs in LAYOUT.items()})
    dead = property(lambda self: self.direct.dead)
    log = property(lambda self: self.direct.log)
    pending = property(lambda self: self.direct.pending + len(self._answers))

    def live(self, ranks: Any) -> list[int]:
        return self.direct.live(ranks)

    def declare_dead(self, rank: int, reason: str) -> None:
        self.direct.declare_dead(rank, reason)

    def send(self, rank: int, request: Mapping[str, Any], timeout: Any) -> int:
        return self.direct.send(rank, request, timeout)

    def send_relay(self, name: str, request: Mapping[str, Any], timeout: Any) -> int:
        self._seq += 1
        self.asked.append((name, dict(request)))
        own = LocalPool({r: self.trainers[r] for r in LAYOUT[name]}, fail=self.fail)
        answer = answer_relay_request(own, frozenset(LAYOUT[name]), name,
                                      decode(encode(request)))
        for rank, why in own.dead.items():
            self.direct.declare_dead(rank, why)  # the relay forwards its ranks' deaths
        self.answered.append(answer)
        self._answers.append(Reply(LAYOUT[name][0], decode(encode(answer)), None, self._seq))
        return self._seq

    def receive(self, block: bool = True, until: Any = None) -> Reply | None:
        return self._answers.pop(0) if self._answers else self.direct.receive(block, until)


def context(pool: Relayed) -> StrategyContext:
    return StrategyContext(task=task(), aggregator=meshkit.plugins.create("aggregator", "fedavg"),
                           pool=pool, workers=[1, 2, 3, 4, 5], rng=np.random.default_rng(0),
                           seed=3, outer=meshkit.plugins.create("outer_optimizer", "average"),
                           timeout=30.0)


def plaintext(state: Mapping[str, Any], clients: list[int], bits: int,
              params: Any) -> np.ndarray:
    trainer = Trainer(task())
    trainer.handle({"op": "set_state", "seq": 1, "state": dict(state)})
    total = np.zeros(sum(state[k].size for k in vector_keys(state)), vector_dtype(bits))
    for client in clients:
        reply = trainer.handle({"op": "fit", "seq": 2, "shard": client, "shards": CLIENTS,
                                "seed": 50 + client})
        add_mod(total, quantize(update_vector(reply["state"], state, vector_keys(state)),
                                params), bits, out=total)
    return total


def play(pool: Relayed) -> tuple[Mapping[str, Any], Any]:
    ctx = context(pool)
    state = ctx.task.init_state(3)
    return state, secure_sum(ctx, list(range(CLIENTS)), state=state,
                             scheme=secagg(degree=0, threshold=5), rnd=1,
                             shards=CLIENTS, seeds={c: 50 + c for c in range(CLIENTS)})


def test_each_relay_sends_one_masked_sum_and_the_unmasked_total_is_exact():
    pool = Relayed()
    state, revealed = play(pool)
    assert sorted(name for name, q in pool.asked if q["op"] == "masked_sum") == [
        "hostA", "hostB"]
    direct = [r for r, q in pool.log if q["op"] == "secagg_mask"]
    assert direct == [5]  # the relayed ranks' masks went through their relays
    assert revealed.contributors == tuple(range(CLIENTS))
    np.testing.assert_array_equal(revealed.total, plaintext(state, list(range(CLIENTS)), 32,
                                                            revealed.params))


def test_a_rank_lost_behind_its_relay_drops_its_clients_before_masking_only():
    pool = Relayed(fail=lambda rank, q: "gone" if rank == 2 and q["op"] == "secagg_mask"
                   else None)
    state, revealed = play(pool)
    assert pool.dead == {2: "gone"}
    survivors = [c for c in range(CLIENTS) if c not in (1, 6)]  # rank 2 played 1 and 6
    assert revealed.contributors == tuple(survivors) and revealed.dropped == (1, 6)
    np.testing.assert_array_equal(revealed.total, plaintext(state, survivors, 32,
                                                            revealed.params))


class _FailsToMask(Trainer):
    def handle(self, request: Any) -> dict[str, Any]:
        if request.get("op") == "secagg_mask":
            return {"error": "secagg_mask: RuntimeError: broken on purpose",
                    "seq": request["seq"]}
        return super().handle(request)


@pytest.mark.parametrize("accept", [True, False])
def test_an_error_reply_behind_a_relay_costs_that_rank_only_and_the_relay_sums_the_rest(accept):
    pool = Relayed()
    pool.trainers[2] = _FailsToMask(task())  # behind hostA with rank 1
    ctx = context(pool)
    state = ctx.task.init_state(3)
    call = lambda: secure_sum(ctx, list(range(CLIENTS)), state=state,  # noqa: E731
                              scheme=secagg(degree=0, threshold=5), rnd=1,
                              shards=CLIENTS, seeds={c: 50 + c for c in range(CLIENTS)},
                              accept_failures=accept)
    if not accept:
        with pytest.raises(meshkit.WorkerError, match="broken on purpose"):
            call()
        return
    revealed = call()
    # Rank 2 (clients 1 and 6) is left out of hostA's sum; rank 1's input is in it.
    survivors = [c for c in range(CLIENTS) if c not in (1, 6)]
    assert revealed.contributors == tuple(survivors) and pool.dead == {}
    assert "rank 2 failed: secagg_mask: RuntimeError: broken on purpose" in \
        revealed.not_served[1]
    np.testing.assert_array_equal(revealed.total, plaintext(state, survivors, 32,
                                                            revealed.params))


@pytest.mark.parametrize("change, message", [
    ({"ranks": [1, 1]}, "distinct worker ranks"),
    ({"modulus_bits": 70}, "modulus_bits must be 1..64"),
    ({"9/clients": [0]}, "names no rank it lists"),
    ({"extra": 1}, "unknown field 'extra'"),
    ({"0/seeds": "x"}, "seeds"),
])
def test_a_malformed_masked_sum_request_is_refused_by_the_relay(change, message):
    request = masked_sum_request({1: {"op": "secagg_mask", "clients": [0], "seeds": [1],
                                      "shards": 2, "senders": [], "recipients": [],
                                      "sealed": np.zeros((0, 168), np.uint8)}}, 32, None)
    with pytest.raises(meshkit.ProtocolError, match=message):
        serve_masked_sum(LocalPool({1: Trainer(task())}), frozenset({1}),
                         {**request, **change})
    answer = answer_relay_request(LocalPool({1: Trainer(task())}), frozenset({1}), "hostA",
                                  {**request, **change})
    assert message in answer["error"] or "seeds" in answer["error"]


def test_relays_add_packed_int8_vectors_exactly_and_send_one_packed_sum_each():
    options = {"bits": 8}
    pool = Relayed()
    ctx = context(pool)
    ctx.compression = CompressionPlan("quantize", options, meshkit.plugins.create(
        "compression", "quantize", options))
    state = ctx.task.init_state(3)
    revealed = secure_sum(ctx, list(range(CLIENTS)), state=state,
                          scheme=secagg(degree=0, threshold=5, clip_range=0.5), rnd=1,
                          shards=CLIENTS, seeds={c: 50 + c for c in range(CLIENTS)})
    bits = revealed.params.modulus_bits
    assert bits == 8 + 4  # int8 codes of 10 clients
    length = sum(state[k].size for k in vector_keys(state))
    assert len(pool.answered) == 2
    for answer in pool.answered:  # one packed sum per relay, 12 bits an element
        assert answer["vector"].dtype == np.uint8 and answer["elements"] == length + 2
        assert answer["vector"].nbytes == -(-(length + 2) * bits // 8)
    trainer = Trainer(task())
    trainer.handle({"op": "set_state", "seq": 1, "state": dict(state)})
    codes = np.zeros(length, vector_dtype(bits))
    for client in range(CLIENTS):
        reply = trainer.handle({"op": "fit", "seq": 2, "shard": client, "shards": CLIENTS,
                                "seed": 50 + client})
        update = update_vector(reply["state"], state, vector_keys(state))
        add_mod(codes, field_codes(ctx.compression.compressor, update,
                                   seed=key_seed(50 + client, 0), clip_range=0.5,
                                   dtype=vector_dtype(bits)), bits, out=codes)
    np.testing.assert_array_equal(revealed.total, codes)
