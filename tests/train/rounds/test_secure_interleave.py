"""The cohort placed along SecAgg+'s ring (the trait ``interleave``), and the degree it allows.

The kernel draws the round's seed first, asks the scheme for its order and
places the clients round-robin on the live workers in that order; secagg+
plans ``degree = "auto"`` for that placement. What is checked here against
the real graph (:func:`meshkit_secagg._graph.neighbours` on a real seed), not
against the planner's own arithmetic: losing any worker at any step leaves
every client a threshold of holders, and half the other workers colluding
never hold a threshold of any client's shares.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import numpy as np
import pytest

import meshkit.train._rounds.secure as secure_round
from meshkit.secure_aggregation import choose
from meshkit.train import round_params
from meshkit.train._rounds.secure import interleaved_order, plan_cohort
from meshkit_secagg._graph import neighbours, ring
from meshkit_secagg._interleave import interleaved_degree

from tests.train.rounds.test_secure_round import CLIENTS, context, dies_at, plaintext, play


def ringed(**options: Any) -> Any:
    return choose("secagg+", {"clip_range": 1.0, **options})


@pytest.mark.parametrize("clients,workers,expected,blind", [
    (100, 4, (8, 5), (50, 26)), (12, 3, (2, 2), (8, 5)), (10, 5, (4, 3), (4, 3))])
def test_the_interleaved_degree_is_far_below_the_placement_blind_one(clients, workers,
                                                                       expected, blind):
    per_worker = -(-clients // workers)
    placed = round_params(ringed(), clients, per_worker=per_worker, interleave=workers)
    unplaced = round_params(ringed(), clients, per_worker=per_worker)
    assert (placed.degree, placed.threshold) == expected
    assert (unplaced.degree, unplaced.threshold) == blind


def test_two_workers_or_too_many_to_check_keep_the_placement_blind_rule():
    assert interleaved_degree(100, 2, 0.3) is None  # one lost worker is half the holders
    assert interleaved_degree(1000, 40, 0.3) is None  # C(40, <12) splits: not attempted


def _holders(graph: dict[int, tuple[int, ...]], client: int) -> set[int]:
    return {client, *graph[client]}


@pytest.mark.parametrize("clients,workers", [(100, 4), (12, 3), (37, 5), (100, 10)])
def test_any_worker_lost_at_any_step_leaves_every_client_a_threshold_of_holders(clients,
                                                                                 workers):
    lost = max(1, int(0.3 * workers))
    for trial in range(3):
        seed = os.urandom(32)
        cohort = list(range(clients))
        live = list(range(1, workers + 1))
        plan = plan_cohort(cohort, live, order=ring(seed, cohort))
        params = round_params(ringed(), clients, per_worker=max(map(len, plan.values())),
                              interleave=len(plan))
        k, t = params.effective_degree, params.threshold
        rank_of = {c: r for r, cs in plan.items() for c in cs}
        for gone in itertools.combinations(live, lost):
            for before in range(lost + 1):  # the first `before` are gone before the graph
                early = set(gone[:before])
                members = [c for c in cohort if rank_of[c] not in early]
                graph = neighbours(seed, members, k)
                late = set(gone)
                for client in members:
                    left = {h for h in _holders(graph, client) if rank_of[h] not in late}
                    assert len(left) >= t, (trial, gone, before, client)
        # Half the other workers, colluding with the coordinator, hold fewer than t shares.
        graph = neighbours(seed, cohort, k)
        for client in cohort:
            others = [r for r in live if r != rank_of[client]]
            for coalition in itertools.combinations(others, min(workers // 2, len(others))):
                held = sum(1 for h in graph[client] if rank_of[h] in coalition)
                assert held < t, (client, coalition)


def test_the_kernel_places_the_cohort_round_robin_along_the_schemes_order():
    seed = bytes(range(32))
    order = interleaved_order(ringed(), list(range(12)), seed)
    assert sorted(order) == list(range(12)) and order == list(ring(seed, range(12)))
    plan = plan_cohort(range(12), [1, 2, 3], order=order)
    assert plan == {r: sorted(order[i::3]) for i, r in enumerate([1, 2, 3])}
    assert order != list(range(12))  # not client order: the ring's


@pytest.mark.parametrize("op", ["secagg_keys", "secagg_share", "secagg_open", "secagg_mask",
                                "secagg_unmask"])
def test_a_ringed_round_survives_losing_any_one_of_three_workers_at_any_step(op, monkeypatch):
    # 10 clients over 3 workers along the ring: degree 6, threshold 4 (8 and 5 in client
    # order; 10 is not a multiple of 3, so the ring's wrap puts two of rank 1's clients side
    # by side). Whichever step rank 2 is lost at, the round unmasks the exact sum of the rest.
    seed = bytes(range(7, 39))
    monkeypatch.setattr(secure_round.secrets, "token_bytes", lambda n: seed[:n])
    scheme = ringed()
    params = round_params(scheme, CLIENTS, per_worker=4, interleave=3)
    assert (params.degree, params.threshold) == (6, 4)
    played = sorted(ring(seed, range(CLIENTS))[1::3])  # rank 2 is the second of three
    ctx = context(3, fail=dies_at(op, {2}))
    state, revealed = play(ctx, scheme=scheme)
    gone = () if op == "secagg_unmask" else played
    contributors = [c for c in range(CLIENTS) if c not in gone]
    assert revealed.contributors == tuple(contributors)
    assert (revealed.params.degree, revealed.params.threshold) == (6, 4)
    np.testing.assert_array_equal(revealed.total,
                                  plaintext(state, contributors, revealed.params))
