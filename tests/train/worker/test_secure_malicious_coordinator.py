"""A coordinator that lies, against real workers: signed rounds refuse it (docs/secure-aggregation.md).

Each attack is played twice with :class:`tests.support.malicious_coordinator.Driver`:
against workers without a roster (the attack works: the red team rebuilds
one client's quantised update, or the workers seal their secrets to the
coordinator's keys), and against workers with ``--roster`` (no honest
client reveals what would unmask an update, and the same recovery fails).
"""

from __future__ import annotations

import numpy as np
import pytest

from meshkit.secure_aggregation import from_wire
from tests.support.malicious_coordinator import Driver, recover, shares_of

pytestmark = pytest.mark.filterwarnings("ignore")


def _error(reply: dict) -> str:
    return str(reply.get("error") or "")


# -- (a) a client's advert substituted ----------------------------------------------------

@pytest.mark.parametrize("how", ["own key", "replayed signature", "unsigned"])
def test_a_substituted_advert_is_refused_before_any_secret_is_sealed(how):
    driver = Driver(5, roster=True)
    driver.start()
    fake = driver.choice.scheme.client(driver.params, 0, bytes(range(32)), driver.length)
    advert = fake.advertise()
    adverts, signers, signatures = (dict(driver.adverts), dict(driver.signers),
                                    dict(driver.signatures))
    adverts[0] = advert  # client 0's keys, as its neighbours see them, are the coordinator's
    if how == "own key":
        signers[0], signatures[0] = driver.own_advert_signature(0, advert)
    elif how == "unsigned":
        signatures[0] = bytes(64)
    for rank in driver.ranks[1:]:
        reply = driver.share(rank, adverts, signers, signatures)
        assert "SignatureError" in _error(reply) and "client 0's advert" in _error(reply)
        assert "sealed" not in reply
        # Nothing was sealed, so nothing can be masked or revealed either.
        assert "error" in driver.mask(rank)


def test_without_a_roster_a_substituted_advert_gets_secrets_sealed_to_the_coordinators_key():
    # What the roster prevents: the worker seals its client's shares to the coordinator.
    driver = Driver(5, roster=False)
    driver.start()
    fake = driver.choice.scheme.client(driver.params, 0, bytes(range(32)), driver.length)
    adverts = {**driver.adverts, 0: fake.advertise()}
    reply = driver.share(2, adverts, driver.signers, driver.signatures)
    row = next(bytes(s) for r, s in zip(reply["recipients"], reply["sealed"]) if int(r) == 0)
    fake.share(sorted(adverts), adverts)
    assert fake.open([(1, row)]) == ()  # it opens: the coordinator holds client 1's shares


# -- (b) the coordinator plays a client's neighbours -------------------------------------

def _play_neighbours(driver: Driver) -> tuple[dict, np.ndarray | None]:
    """Rank 1 (client 0) is sent a cohort of the coordinator's own clients 1-4 (signed with
    its own key); the red team unmasks client 0 with their shares. The reply to the share
    request, and what the red team recovered (None: nothing)."""
    driver.start()
    params, seed = driver.params, bytes(range(32))
    fakes = {c: driver.choice.scheme.client(params, c, seed, driver.length) for c in (1, 2, 3, 4)}
    adverts = {0: driver.adverts[0], **{c: f.advertise() for c, f in fakes.items()}}
    signers, signatures = {0: driver.signers[0]}, {0: driver.signatures[0]}
    for c in fakes:
        signers[c], signatures[c] = driver.own_advert_signature(c, adverts[c])
    reply = driver.share(1, adverts, signers, signatures)
    if "error" in reply:
        return reply, None
    for_fakes = {int(r): bytes(s) for r, s in zip(reply["recipients"], reply["sealed"])}
    to_target = []
    for c, fake in fakes.items():
        to_target += [(c, row) for r, row in fake.share(sorted(adverts), adverts) if r == 0]
        assert fake.open([(0, for_fakes[c])]) == ()  # client 0's shares, sealed to the fake
    assert driver.open(1, to_target)["senders"] == []
    masked = driver.mask(1)
    if "error" in masked:
        return reply, None
    vector = from_wire(masked, params.modulus_bits)
    # The fakes are the coordinator's: it reads both of client 0's secrets' shares they
    # opened (an honest client would reveal only one kind per owner).
    held = [fake.round._held[0] for fake in fakes.values()]
    return reply, recover(driver, 0, vector, [h[0] for h in held], [h[1] for h in held],
                          adverts)


def test_without_a_roster_a_coordinator_playing_the_neighbours_recovers_the_update():
    driver = Driver(5, roster=False)
    reply, recovered = _play_neighbours(driver)
    assert "error" not in reply
    assert recovered is not None
    np.testing.assert_array_equal(recovered, driver.plaintext(1))


def test_with_a_roster_a_coordinator_playing_the_neighbours_recovers_nothing():
    driver = Driver(5, roster=True)
    reply, recovered = _play_neighbours(driver)
    assert "SignatureError" in _error(reply) and "not an admitted key" in _error(reply)
    assert recovered is None


# -- (c) two survivors told different sets ------------------------------------------------

A, B = [0, 1, 2], [3, 4, 5]


def _equivocate(driver: Driver, confirmations: str) -> tuple[dict[int, dict], np.ndarray | None]:
    """Clients A are told "A survived, B dropped", clients B the opposite; each group's
    unmask request carries ``confirmations`` ("own": its own group's, "all": everyone's,
    "none"). The replies, and client 0's update as the red team rebuilds it from A's seed
    shares and B's key shares (None: they do not rebuild both)."""
    vectors, _ = driver.honest_until_masked()
    told = {c: (A, B) if c in A else (B, A) for c in A + B}
    got = {}
    for rank in driver.ranks:
        reply = driver.confirm(rank, *told[driver.client_of(rank)])
        if "error" not in reply:
            got[driver.client_of(rank)] = (bytes(reply["signer"][0]),
                                           bytes(reply["signatures"][0]))
    replies = {}
    for rank in driver.ranks:
        client = driver.client_of(rank)
        survivors, dropped = told[client]
        shown = (None if confirmations == "none" else
                 {c: s for c, s in got.items() if c in survivors or confirmations == "all"})
        replies[client] = driver.unmask(rank, survivors, dropped, shown)
    seed_shares = [s for c in A for s in shares_of(replies[c], 0, 0)]
    key_shares = [s for c in B for s in shares_of(replies[c], 0, 1)]
    return replies, recover(driver, 0, vectors[0], seed_shares, key_shares)


def test_without_a_roster_two_survivor_sets_unmask_one_clients_update():
    # The attack the consistency check exists for: t = 3 of 6 holders, two groups of 3.
    driver = Driver(6, roster=False, threshold=3)
    replies, recovered = _equivocate(driver, "none")
    assert all("error" not in r for r in replies.values())
    assert recovered is not None
    np.testing.assert_array_equal(recovered, driver.plaintext(1))


@pytest.mark.parametrize("confirmations", ["own", "all", "none"])
def test_with_a_roster_no_survivor_told_another_set_reveals_a_share(confirmations):
    driver = Driver(6, roster=True, threshold=3)
    replies, recovered = _equivocate(driver, confirmations)
    for client, reply in replies.items():
        assert "error" in reply and "shares" not in reply, client
        assert "EquivocationError" in reply["error"] or "protocol error" in reply["error"]
    assert recovered is None


def test_the_consistency_check_names_what_it_refused():
    driver = Driver(6, roster=True, threshold=3)
    replies, _ = _equivocate(driver, "own")
    assert "3 survivors confirmed the set client 0 was told, and it needs 4" in \
        replies[0]["error"]
    driver = Driver(6, roster=True, threshold=3)
    replies, _ = _equivocate(driver, "none")
    assert "confirmed the set client 0 was told" in replies[0]["error"]


def test_a_survivor_set_changed_after_the_confirmation_is_refused():
    driver = Driver(5, roster=True)
    driver.honest_until_masked()
    everyone = [0, 1, 2, 3, 4]
    got = {}
    for rank in driver.ranks:
        reply = driver.confirm(rank, everyone, [])
        got[driver.client_of(rank)] = (bytes(reply["signer"][0]), bytes(reply["signatures"][0]))
    # Told everyone survived, then asked to unmask as if client 4 dropped.
    reply = driver.unmask(1, [0, 1, 2, 3], [4], {c: got[c] for c in (0, 1, 2, 3)})
    assert "EquivocationError" in reply["error"] and "changed the set" in reply["error"]
    # A second confirmation of another set is refused too.
    assert "confirms one only" in driver.confirm(1, [0, 1, 2, 3], [4])["error"]
    # The honest request is answered.
    assert "shares" in driver.unmask(1, everyone, [], got)


def test_an_honest_signed_round_unmasks_with_every_confirmation():
    driver = Driver(5, roster=True)
    driver.honest_until_masked()
    everyone = [0, 1, 2, 3, 4]
    got = {}
    for rank in driver.ranks:
        reply = driver.confirm(rank, everyone, [])
        got[driver.client_of(rank)] = (bytes(reply["signer"][0]), bytes(reply["signatures"][0]))
    for rank in driver.ranks:
        reply = driver.unmask(rank, everyone, [], got)
        assert "error" not in reply and len(reply["shares"]) == 5  # b of all 5 survivors


def test_the_auto_threshold_alone_keeps_two_halves_of_honest_holders_from_unmasking():
    # 6 clients on the complete graph: t = 4 of 6 holders (a strict majority), so even
    # unsigned, two groups of 3 told different sets cannot each rebuild a secret.
    driver = Driver(6, roster=False)
    assert driver.params.threshold == 4
    _, recovered = _equivocate(driver, "none")
    assert recovered is None
