"""Signed secure rounds through the coordinator's round (meshkit/train/_rounds/secure.py) over a LocalPool.

Every worker signs with its node key and checks with the roster; the round
adds ``secagg_confirm`` and unmasks the same sum as an unsigned one. A
worker that signs nothing is named by every worker with a roster, which
then shares nothing; a worker whose signatures do not verify is in breach.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshkit.errors import RefusedError
from meshkit.secure_aggregation import Roster
from meshkit.train import Signing, Trainer
from meshkit.wire import AuthorizedKey, AuthorizedNodes, NodeKey
from tests.train.rounds.test_secure_round import CLIENTS, context, plaintext, play, task

KEYS = {r: NodeKey(Ed25519PrivateKey.generate()) for r in range(1, 6)}
ROSTER = Roster(frozenset(k.public for k in KEYS.values()), "the test roster")


def signed_workers(roster: bool = True, unsigned: frozenset[int] = frozenset()
                   ) -> dict[int, Trainer]:
    workers = {r: Trainer(task()) for r in KEYS}
    for rank, trainer in workers.items():
        if rank not in unsigned:
            trainer.secure.signing = Signing(KEYS[rank], ROSTER if roster else None)
    return workers


def ops(ctx: Any) -> list[str]:
    return [q["op"] for _, q in ctx.pool.log]


def test_a_signed_round_confirms_the_survivors_and_unmasks_the_plaintext_sum():
    ctx = context(5, trainers=signed_workers())
    state, revealed = play(ctx)
    assert revealed.contributors == tuple(range(CLIENTS)) and revealed.not_served == {}
    np.testing.assert_array_equal(revealed.total,
                                  plaintext(state, list(range(CLIENTS)), revealed.params))
    assert ops(ctx).count("secagg_confirm") == 5
    unmask = [q for _, q in ctx.pool.log if q["op"] == "secagg_unmask"]
    assert all(list(q["confirmed"]) == list(range(CLIENTS)) for q in unmask)
    shares = [q for _, q in ctx.pool.log if q["op"] == "secagg_share"]
    assert all(q["signatures"].shape == (CLIENTS, 64) for q in shares)


def test_a_signed_round_survives_a_worker_lost_before_confirming():
    def fail(rank: int, request: Mapping[str, Any]) -> str | None:
        return "rank 2 died" if rank == 2 and request["op"] == "secagg_confirm" else None

    ctx = context(5, fail=fail, trainers=signed_workers())
    state, revealed = play(ctx)
    # Its clients' masked inputs arrived: they are in the sum; 8 of 10 confirmed.
    assert revealed.contributors == tuple(range(CLIENTS))
    np.testing.assert_array_equal(revealed.total,
                                  plaintext(state, list(range(CLIENTS)), revealed.params))
    unmask = [q for _, q in ctx.pool.log if q["op"] == "secagg_unmask"]
    assert all(list(q["confirmed"]) == [0, 2, 3, 4, 5, 7, 8, 9] for q in unmask)


def test_a_worker_that_signs_nothing_is_named_and_roster_workers_share_nothing_with_it(caplog):
    ctx = context(5, trainers=signed_workers(unsigned=frozenset({3})))
    with pytest.raises(RefusedError, match="0 clients shared their secrets"):
        play(ctx)
    assert "secagg_confirm" not in ops(ctx) and "secagg_mask" not in ops(ctx)
    refused = [m for m in caplog.messages if "failed a secure round step" in m]
    assert len(refused) == 4  # ranks 1, 2, 4, 5; rank 3 (clients 2, 7) has no roster
    assert all("client 2's advert is unsigned" in m for m in refused)


def test_without_a_roster_a_signed_round_is_checked_by_nobody_and_still_sums():
    ctx = context(5, trainers=signed_workers(roster=False))
    state, revealed = play(ctx)
    np.testing.assert_array_equal(revealed.total,
                                  plaintext(state, list(range(CLIENTS)), revealed.params))


class _Garbling(Trainer):
    """Rank 4's worker: its advert signatures are zeros."""

    def handle(self, request: Mapping[str, Any]) -> dict[str, Any]:
        reply = super().handle(request)
        if request.get("op") == "secagg_keys":
            reply["signatures"] = np.zeros_like(reply["signatures"])
        return reply


def test_a_worker_whose_advert_signature_does_not_verify_is_in_breach():
    workers = signed_workers()
    workers[4] = _Garbling(task())
    workers[4].secure.signing = Signing(KEYS[4], ROSTER)
    ctx = context(5, trainers=workers)
    state, revealed = play(ctx)
    assert list(ctx.dead) == [4] and "does not verify" in ctx.dead[4]
    contributors = [c for c in range(CLIENTS) if c not in (3, 8)]
    assert revealed.contributors == tuple(contributors)
    np.testing.assert_array_equal(revealed.total, plaintext(state, contributors,
                                                            revealed.params))


def _authorized(bound: bool = True) -> AuthorizedNodes:
    """The coordinator's ``[mesh] authorized_nodes``: each rank's key, bound to its rank."""
    return AuthorizedNodes("the test authorized_nodes", tuple(
        AuthorizedKey(k.public, frozenset({r}) if bound else frozenset())
        for r, k in KEYS.items()))


@pytest.mark.parametrize("signer, reason", [
    # Rank 2's key: every worker's roster admits it, only the coordinator's binds it to rank 2.
    (KEYS[2], "is bound to rank 2"),
    # A key nobody lists: without the coordinator's check every roster worker refuses the round.
    (NodeKey(Ed25519PrivateKey.generate()), "is unknown"),
])
def test_the_coordinator_drops_a_rank_whose_adverts_its_authorized_nodes_do_not_admit(
        signer, reason):
    workers = signed_workers()
    workers[4].secure.signing = Signing(signer, ROSTER)
    ctx = context(5, trainers=workers)
    ctx.authorized_nodes = _authorized()
    state, revealed = play(ctx)
    assert list(ctx.dead) == [4]
    assert "authorized_nodes does not admit for rank 4" in ctx.dead[4] and reason in ctx.dead[4]
    contributors = [c for c in range(CLIENTS) if c not in (3, 8)]
    assert revealed.contributors == tuple(contributors)
    np.testing.assert_array_equal(revealed.total, plaintext(state, contributors,
                                                            revealed.params))


def test_keys_the_authorized_nodes_admit_for_any_rank_sign_for_every_rank():
    ctx = context(5, trainers=signed_workers())
    ctx.authorized_nodes = _authorized(bound=False)
    _, revealed = play(ctx)
    assert ctx.dead == {} and revealed.contributors == tuple(range(CLIENTS))
