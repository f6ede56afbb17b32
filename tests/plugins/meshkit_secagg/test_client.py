"""A client's round: what its masked upload reveals (nothing alone), and what it refuses to reveal."""

from __future__ import annotations

import math

import numpy as np
import pytest

from meshkit import RefusedError
from meshkit_secagg import (ClientRound, KeyAdvert, Roster, SealedShares, SecAggError,
                            SecAggParams, ServerRound, ShareDelivery, UnmaskRequest, quantize)

PARAMS = SecAggParams(clients=6, degree=0, threshold=3, clip_range=1.0, modulus_bits=32)


def _round(seed: bytes, length: int = 16, params: SecAggParams = PARAMS):
    clients = {c: ClientRound(params, c, seed, length) for c in range(params.clients)}
    server = ServerRound(params, range(params.clients), seed, length)
    for c in clients.values():
        server.receive_advert(c.advertise())
    rosters = server.rosters()
    for c, roster in rosters.items():
        server.receive_shares(clients[c].share(roster))
    return clients, server, server.deliveries()


def _chi_square_bound(dof: int, z: float = 5.0) -> float:
    """The chi-square quantile ``z`` standard deviations up (Wilson-Hilferty), about p = 3e-7."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def test_a_masked_upload_is_uniform_mod_2_to_the_bits(round_seed: bytes) -> None:
    # The most structured update there is (every coordinate the same value),
    # masked: its high byte, low byte and a middle byte are each uniform.
    length = 1 << 16
    clients, _, deliveries = _round(round_seed, length)
    update = quantize(np.full(length, 0.25), PARAMS)
    masked = clients[0].mask(deliveries[0], update).vector
    assert len(np.unique(update)) == 1
    for shift in (0, 12, 24):
        counts = np.bincount((masked >> np.uint32(shift)) & np.uint32(0xFF), minlength=256)
        expected = length / 256
        statistic = float(((counts - expected) ** 2 / expected).sum())
        assert statistic < _chi_square_bound(255), (shift, statistic)


def test_masks_cancel_only_in_the_sum(round_seed: bytes) -> None:
    length = 1000
    clients, _, deliveries = _round(round_seed, length)
    zero = quantize(np.zeros(length), PARAMS)
    masked = [clients[c].mask(deliveries[c], zero).vector for c in range(6)]
    assert all(not np.array_equal(m, zero) for m in masked)


def test_a_client_reveals_nothing_when_fewer_than_threshold_survive(round_seed: bytes) -> None:
    clients, _, deliveries = _round(round_seed)
    client = clients[0]
    client.mask(deliveries[0], quantize(np.zeros(16), PARAMS))
    with pytest.raises(RefusedError, match="2 survivors, fewer than the threshold 3"):
        client.unmask(UnmaskRequest(0, (0, 1), (2, 3, 4, 5)))


def test_a_request_that_leaves_a_neighbour_unaccounted_is_the_coordinators_fault(
        round_seed: bytes) -> None:
    clients, _, deliveries = _round(round_seed)
    clients[0].mask(deliveries[0], quantize(np.zeros(16), PARAMS))
    with pytest.raises(SecAggError, match=r"leaves neighbours \[5\]") as caught:
        clients[0].unmask(UnmaskRequest(0, (0, 1, 2), (3, 4)))
    assert caught.value.client is None


def test_a_client_answers_seed_shares_for_survivors_and_key_shares_for_the_dropped(
        round_seed: bytes) -> None:
    clients, _, deliveries = _round(round_seed)
    clients[2].mask(deliveries[2], quantize(np.zeros(16), PARAMS))
    reply = clients[2].unmask(UnmaskRequest(2, (0, 1, 2, 3), (4, 5)))
    # Its own seed's share too (it holds one share of each of its secrets); never its own key's.
    assert [o for o, _ in reply.seed_shares] == [0, 1, 2, 3]
    assert [o for o, _ in reply.key_shares] == [4, 5]


def test_a_tampered_sealed_share_is_blamed_on_its_sender(round_seed: bytes) -> None:
    clients, _, deliveries = _round(round_seed)
    delivery = deliveries[0]
    first = delivery.shares[0]
    flipped = first.sealed[:-1] + bytes([first.sealed[-1] ^ 1])
    tampered = ShareDelivery(0, (SealedShares(first.sender, 0, flipped), *delivery.shares[1:]))
    with pytest.raises(SecAggError, match="do not authenticate") as caught:
        clients[0].mask(tampered, quantize(np.zeros(16), PARAMS))
    assert caught.value.client == first.sender


def test_shares_sealed_for_another_recipient_do_not_open(round_seed: bytes) -> None:
    clients, _, deliveries = _round(round_seed)
    # The coordinator forwards to 0 what 1 sealed for 2: the wrong key and the wrong binding.
    stray = next(s for s in deliveries[2].shares if s.sender == 1)
    rest = tuple(s for s in deliveries[0].shares if s.sender != 1)
    forged = ShareDelivery(0, tuple(sorted((SealedShares(1, 0, stray.sealed), *rest),
                                           key=lambda s: s.sender)))
    with pytest.raises(SecAggError) as caught:
        clients[0].mask(forged, quantize(np.zeros(16), PARAMS))
    assert caught.value.client == 1


def test_a_roster_without_the_neighbours_adverts_is_the_coordinators_fault(
        round_seed: bytes) -> None:
    clients = [ClientRound(PARAMS, c, round_seed, 4) for c in range(6)]
    adverts = [c.advertise() for c in clients]
    with pytest.raises(SecAggError, match="not from this client's neighbours") as caught:
        clients[0].share(Roster(0, tuple(range(6)), tuple(adverts[1:5])))
    assert caught.value.client is None


def test_a_small_order_public_key_is_blamed_on_its_advertiser(round_seed: bytes) -> None:
    clients = [ClientRound(PARAMS, c, round_seed, 4) for c in range(6)]
    adverts = [c.advertise() for c in clients]
    evil = KeyAdvert(3, bytes(32), adverts[3].mask_key, adverts[3].seed_commitment)
    roster = Roster(0, tuple(range(6)), (*adverts[1:3], evil, *adverts[4:]))
    with pytest.raises(SecAggError, match="client 3's share key") as caught:
        clients[0].share(roster)
    assert caught.value.client == 3


def test_too_few_neighbours_for_the_threshold_is_refused(round_seed: bytes) -> None:
    # Threshold 3: one neighbour and its own share are two holders, one too few.
    clients = [ClientRound(PARAMS, c, round_seed, 4) for c in range(2)]
    adverts = [c.advertise() for c in clients]
    with pytest.raises(RefusedError, match="1 neighbours and its own share, fewer than the "
                                           "threshold 3"):
        clients[0].share(Roster(0, (0, 1), tuple(adverts[1:])))


def test_stages_run_once_and_in_order(round_seed: bytes) -> None:
    client = ClientRound(PARAMS, 0, round_seed, 4)
    with pytest.raises(RuntimeError, match="out of order"):
        client.unmask(UnmaskRequest(0, (0, 1, 2), ()))
    client.advertise()
    with pytest.raises(RuntimeError, match="out of order"):
        client.advertise()


def test_an_update_not_quantised_for_the_round_is_refused(round_seed: bytes) -> None:
    clients, _, deliveries = _round(round_seed)
    with pytest.raises(ValueError, match="uint32 vector of 16"):
        clients[0].mask(deliveries[0], np.zeros(16, np.float32))
    clients2, _, deliveries2 = _round(round_seed)
    with pytest.raises(ValueError, match="above"):
        clients2[0].mask(deliveries2[0], np.full(16, PARAMS.levels + 1, np.uint32))
