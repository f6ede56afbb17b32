"""A grid round (``[compression] clip_range``) behind host relays, in-process: each relay adds its
ranks' integer sums of codes and sends one sum up.

The relays are the kernel's relay side (``answer_relay_request``, what ``meshkit relay``
runs) over in-process workers; the requests cross the wire encoding both ways. The
ranks' ``fit_batch`` requests go straight to them, as a relay forwards them.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import pytest

import meshkit.plugins
from meshkit.train import (LocalPool, Reply, StrategyContext, Trainer, answer_relay_request,
                           decode, encode, fold_round)

from tests.compression.test_grid import per_client, plan
from tests.support.rounds import fits, same_bytes, synthetic

LAYOUT = {"hostA": [1, 2], "hostB": [3, 4]}  # and rank 5 dialed the coordinator directly
CLIENTS = 20


class Relayed:
    """Rank 0's pool: ranks behind two in-process relays, one direct rank."""

    def __init__(self, fail: Any = None, spoil: Any = None) -> None:
        self.trainers = {r: Trainer(synthetic()) for r in range(1, 6)}
        self.direct = LocalPool(self.trainers)
        self.fail, self.spoil = fail, spoil
        self.asked: list[tuple[str, dict[str, Any]]] = []
        self.answered: list[dict[str, Any]] = []
        self._answers: list[Reply] = []
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

    def abandon(self, ticket: int) -> None:
        self.direct.abandon(ticket)

    def send_relay(self, name: str, request: Mapping[str, Any], timeout: Any) -> int:
        self._seq += 1
        self.asked.append((name, dict(request)))
        own = LocalPool({r: self.trainers[r] for r in LAYOUT[name]}, fail=self.fail)
        answer = answer_relay_request(own, frozenset(LAYOUT[name]), name,
                                      decode(encode(request)))
        for rank, why in own.dead.items():
            self.direct.declare_dead(rank, why)  # the relay forwards its ranks' deaths
        if self.spoil is not None:
            self.spoil(name, answer)
        self.answered.append(answer)
        self._answers.append(Reply(LAYOUT[name][0], decode(encode(answer)), None, self._seq))
        return self._seq

    def receive(self, block: bool = True, until: Any = None) -> Reply | None:
        return self._answers.pop(0) if self._answers else self.direct.receive(block, until)


def context(pool: Relayed) -> StrategyContext:
    ctx = StrategyContext(task=synthetic(),
                          aggregator=meshkit.plugins.create("aggregator", "fedavg"),
                          pool=pool, workers=[1, 2, 3, 4, 5], rng=np.random.default_rng(0),
                          outer=meshkit.plugins.create("outer_optimizer", "average"),
                          timeout=30.0)
    ctx.compression = plan()
    return ctx


def test_each_relay_adds_its_ranks_sums_and_the_model_is_the_per_client_folds_bits():
    pool = Relayed()
    ctx = context(pool)
    state = ctx.task.init_state(0)
    expected, _ = per_client(state, CLIENTS, ctx.compression)
    folded = fold_round(ctx, fits(CLIENTS), state=state)
    assert sorted(folded.served) == list(range(CLIENTS)) and folded.failed == {}
    assert same_bytes(folded.result, expected)
    # One grid_sum a relay; the coordinator pulled only its direct rank's sum itself.
    assert sorted(name for name, q in pool.asked if q["op"] == "grid_sum") == ["hostA", "hostB"]
    assert [r for r, q in pool.log if q["op"] == "take_partial"] == [5]
    assert {r for r, q in pool.log if q["op"] == "fit_batch"} == {1, 2, 3, 4, 5}
    for answer in pool.answered:  # one packed sum a relay, at its total's width
        wire = answer["partial"]
        assert answer["ranks"] in list(LAYOUT.values()) and answer["lost"] == []
        assert wire["bits"] == (wire["mass"] * 255).bit_length()
        for key in (k for k in wire if k.startswith("sum/")):
            assert wire[key].nbytes == -(-wire["n/" + key[4:]] * wire["bits"] // 8)
        assert wire["count"] == sum(1 for r in folded.served.values() if r in answer["ranks"])


def test_a_rank_lost_behind_its_relay_has_its_clients_served_again_and_the_bits_stay():
    pool = Relayed(fail=lambda rank, q: "gone" if rank == 2 and q["op"] == "take_partial"
                   else None)
    ctx = context(pool)
    state = ctx.task.init_state(0)
    expected, _ = per_client(state, CLIENTS, ctx.compression)
    folded = fold_round(ctx, fits(CLIENTS), state=state)
    assert 2 in ctx.dead or 2 in folded.failed
    assert sorted(folded.served) == list(range(CLIENTS)) and 2 not in folded.served.values()
    assert same_bytes(folded.result, expected)


def _lie_about_mass(name: str, answer: dict[str, Any]) -> None:
    if name == "hostB" and "partial" in answer:
        answer["partial"] = {**answer["partial"], "mass": answer["partial"]["mass"] + 1}


def test_a_relay_whose_sum_does_not_fit_loses_its_ranks_and_the_others_serve_the_round():
    pool = Relayed(spoil=_lie_about_mass)
    ctx = context(pool)
    state = ctx.task.init_state(0)
    expected, _ = per_client(state, CLIENTS, ctx.compression)
    folded = fold_round(ctx, fits(CLIENTS), state=state)
    assert sorted(ctx.dead) == [3, 4] and all("protocol error" in ctx.dead[r] for r in (3, 4))
    assert "hostB" in ctx.dead[3] and "weighing" in ctx.dead[3]
    assert sorted(folded.served) == list(range(CLIENTS))
    assert set(folded.served.values()) <= {1, 2, 5}
    assert same_bytes(folded.result, expected)


@pytest.mark.parametrize("message, words", [
    ({"op": "grid_sum", "ranks": [], "timeout": 1.0}, "distinct worker ranks"),
    ({"op": "grid_sum", "ranks": [9], "timeout": 1.0}, "does not carry"),
    ({"op": "grid_sum", "ranks": [1], "timeout": 1.0, "x": 1}, "unknown fields"),
])
def test_a_malformed_grid_sum_request_is_answered_with_an_error(message, words):
    own = LocalPool({1: Trainer(synthetic())})
    answer = answer_relay_request(own, frozenset([1]), "hostA", message)
    assert words in answer["error"]
