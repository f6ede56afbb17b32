"""Signed rounds' checks (meshkit/secure_aggregation/_signed.py): whose signature counts, and when a client may reveal."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshkit.errors import RefusedError
from meshkit.secure_aggregation import (
    EquivocationError,
    Roster,
    SecureAggregationError,
    SignatureError,
    advert_message,
    check_adverts,
    check_confirmations,
    confirm_message,
    sign,
)
from meshkit.wire import AuthorizedKey, AuthorizedNodes, NodeKey

SEED = bytes(32)
KEYS = {c: NodeKey(Ed25519PrivateKey.generate()) for c in range(5)}
ROSTER = Roster(frozenset(k.public for k in KEYS.values()))
ADVERTS = {c: bytes([c]) * 96 for c in KEYS}


def _signed() -> tuple[dict[int, bytes], dict[int, bytes]]:
    return ({c: k.public for c, k in KEYS.items()},
            {c: sign(KEYS[c], advert_message(SEED, 3, c, ADVERTS[c])) for c in KEYS})


def test_every_advert_signed_by_a_roster_key_passes():
    signers, signatures = _signed()
    check_adverts(ROSTER, SEED, 3, ADVERTS, signers, signatures)


@pytest.mark.parametrize("how, why", [
    ("unsigned", "is unsigned"),
    ("stranger", "is not an admitted key"),
    ("other bytes", "does not verify"),
    ("other round", "does not verify"),
    ("other client", "does not verify"),
])
def test_an_advert_not_signed_as_the_roster_needs_is_refused_naming_the_client(how, why):
    signers, signatures = _signed()
    adverts, rnd = dict(ADVERTS), 3
    if how == "unsigned":
        del signatures[2]
    elif how == "stranger":
        stranger = NodeKey(Ed25519PrivateKey.generate())
        signers[2] = stranger.public
        signatures[2] = sign(stranger, advert_message(SEED, 3, 2, ADVERTS[2]))
    elif how == "other bytes":
        adverts[2] = bytes(96)
    elif how == "other round":
        rnd = 4
        signatures = {c: sign(KEYS[c], advert_message(SEED, 4, c, ADVERTS[c])) for c in KEYS}
        signatures[2] = sign(KEYS[2], advert_message(SEED, 3, 2, ADVERTS[2]))  # a replay
    elif how == "other client":
        signatures[2] = sign(KEYS[2], advert_message(SEED, 3, 1, ADVERTS[2]))
    with pytest.raises(SignatureError, match=f"client 2's advert .*{why}") as caught:
        check_adverts(ROSTER, SEED, rnd, adverts, signers, signatures)
    assert caught.value.client is None  # seen on a worker: the coordinator's doing
    assert isinstance(caught.value, SecureAggregationError)
    with pytest.raises(SignatureError) as blamed:
        check_adverts(ROSTER, SEED, rnd, adverts, signers, signatures, blame=True)
    assert blamed.value.client == 2


def test_a_revoked_key_does_not_count():
    nodes = AuthorizedNodes("nodes", (AuthorizedKey(KEYS[0].public),
                                      AuthorizedKey(KEYS[1].public, revoked=True),
                                      AuthorizedKey(KEYS[1].public)))
    roster = Roster.from_authorized(nodes)
    assert roster.problem(KEYS[0].public) is None
    assert "not an admitted key of nodes" in str(roster.problem(KEYS[1].public))


SURVIVORS, DROPPED = (0, 1, 2, 3), (4,)


def _confirmations(survivors=SURVIVORS, dropped=DROPPED, who=SURVIVORS):
    return [(c, KEYS[c].public, sign(KEYS[c], confirm_message(SEED, 3, c, survivors, dropped)))
            for c in who]


def _check(confirmations, confirmed=(SURVIVORS, DROPPED), threshold=3, survivors=SURVIVORS,
           dropped=DROPPED):
    check_confirmations(ROSTER, SEED, 3, [0], survivors, dropped,
                        {} if confirmed is None else {0: confirmed}, confirmations,
                        {c: k.public for c, k in KEYS.items()}, threshold)


def test_every_client_of_a_worker_must_have_confirmed_the_sets():
    told = (SURVIVORS, DROPPED)
    check_confirmations(ROSTER, SEED, 3, [0, 1], SURVIVORS, DROPPED, {0: told, 1: told},
                        _confirmations(), {c: k.public for c, k in KEYS.items()}, 3)
    with pytest.raises(EquivocationError, match="client 1 is asked to unmask"):
        check_confirmations(ROSTER, SEED, 3, [0, 1], SURVIVORS, DROPPED, {0: told},
                            _confirmations(), {c: k.public for c, k in KEYS.items()}, 3)


def test_a_majority_of_confirmations_of_the_same_sets_lets_a_client_reveal():
    _check(_confirmations())
    _check(_confirmations(who=(0, 1, 2)))  # 3 of the 5 named, and t = 3


@pytest.mark.parametrize("case, match", [
    ("too few", "needs 3"),
    ("no majority", "needs 3"),
    ("other sets", "does not verify over the survivor set"),
    ("other signer", "does not verify over the survivor set"),
    ("not confirmed", "confirmed no survivor set"),
    ("changed", "changed the set after the consistency check"),
    ("non-survivor", "not a survivor"),
])
def test_a_client_refuses_to_reveal_when_the_confirmations_do_not_add_up(case, match):
    confirmations, confirmed, threshold = _confirmations(), (SURVIVORS, DROPPED), 3
    if case == "too few":
        confirmations = _confirmations(who=(0, 1))
    elif case == "no majority":
        threshold = 1
        confirmations = _confirmations(who=(0, 1))  # 2 of the 5 named
    elif case == "other sets":
        confirmations[1] = _confirmations((0, 1, 2), (3, 4), who=(1,))[0]
    elif case == "other signer":
        confirmations[1] = (1, KEYS[2].public, sign(KEYS[2], confirm_message(
            SEED, 3, 1, SURVIVORS, DROPPED)))
    elif case == "not confirmed":
        confirmed = None
    elif case == "changed":
        confirmed = ((0, 1, 2), (3, 4))
    elif case == "non-survivor":
        confirmations.append((4, KEYS[4].public, bytes(64)))
    with pytest.raises(EquivocationError, match=match) as caught:
        _check(confirmations, confirmed, threshold)
    assert isinstance(caught.value, RefusedError)
