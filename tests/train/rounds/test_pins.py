"""Which worker keeps a client's residual (``[compression] residual = "worker"``):
rendezvous pins, and what a fit request names (meshkit/train/_rounds/pins.py)."""

from __future__ import annotations

import pytest

from meshkit.train._rounds.pins import ResidualPins, pin


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
    assert pins.restarts == 0
    gone = first[0][0]
    third = pins.plan([(0, None)], [r for r in (1, 2) if r != gone])
    assert third[0] == ({1: 2, 2: 1}[gone], {"client": 0})
    assert pins.restarts == 1
