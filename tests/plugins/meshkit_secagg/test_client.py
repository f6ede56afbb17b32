"""A client's round: what its masked upload reveals (nothing alone), and what it refuses to reveal."""

from __future__ import annotations

import copy
import math
from typing import Callable

import numpy as np
import pytest

from meshkit import RefusedError
from meshkit_secagg import (ClientRound, KeyAdvert, MaskedInput, MaskedSum, Roster,
                            SealedShares, SecAggError, SecAggParams, ServerRound, ShareDelivery,
                            UnmaskRequest, add_mod, cancelled_pairs, quantize)

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


def test_a_partys_sum_with_its_cancelled_pairs_is_the_same_bits_and_unmasks(
        updates: Callable[[SecAggParams, int], dict[int, np.ndarray]],
        exact_sum: Callable[[dict[int, np.ndarray], tuple[int, ...]], np.ndarray],
        round_seed: bytes) -> None:
    # One party (a worker) plays clients 0-4 and sends their sum: the pairs among them
    # expand no mask, and the sum is bit for bit the sum of the full masked inputs.
    params = SecAggParams(clients=10, degree=4, threshold=3, clip_range=1.0, modulus_bits=24)
    ups = updates(params, 64)
    clients = {c: ClientRound(params, c, round_seed, 64) for c in range(10)}
    server = ServerRound(params, range(10), round_seed, 64)
    for c in clients.values():
        server.receive_advert(c.advertise())
    for c, roster in server.rosters().items():
        server.receive_shares(clients[c].share(roster))
    for c, delivery in server.deliveries().items():
        assert clients[c].open(delivery) == ()
    party = (0, 1, 2, 3, 4)
    cancelled = cancelled_pairs({c: clients[c] for c in party})
    assert any(cancelled.values())  # the graph joins some of them
    assert all(v in party and c in cancelled[v] for c in party for v in cancelled[c])
    full = [copy.copy(clients[c]).mask_opened(ups[c]).vector for c in party]
    short = [clients[c].mask_opened(ups[c], cancelled=cancelled[c]).vector for c in party]
    total, expected = short[0].copy(), full[0].copy()
    for a, b in zip(short[1:], full[1:]):
        add_mod(total, a, 24, out=total)
        add_mod(expected, b, 24, out=expected)
    assert np.array_equal(total, expected)
    assert any(not np.array_equal(a, b) for a, b in zip(short, full))
    server.receive_masked(MaskedSum(party, total))
    for c in range(5, 9):  # client 9 drops after masking
        server.receive_masked(clients[c].mask_opened(ups[c]))
    for c, request in server.unmask_requests().items():
        server.receive_unmask(clients[c].unmask(request))
    result = server.finish()
    assert result.contributors == tuple(range(9)) and result.dropped == (9,)
    assert np.array_equal(result.total.astype(np.uint64), exact_sum(ups, result.contributors))


def test_a_pair_masked_by_one_end_only_is_not_cancelled(round_seed: bytes) -> None:
    clients, _, deliveries = _round(round_seed, 8)
    # Client 1's delivery leaves out client 0's shares: 0 masks with 1, 1 not with 0.
    clients[0].open(deliveries[0])
    clients[1].open(ShareDelivery(1, tuple(s for s in deliveries[1].shares if s.sender != 0)))
    clients[2].open(deliveries[2])
    assert cancelled_pairs({c: clients[c] for c in (0, 1, 2)}) == {
        0: frozenset({2}), 1: frozenset({2}), 2: frozenset({0, 1})}
    assert isinstance(clients[0].mask_opened(quantize(np.zeros(8), PARAMS), cancelled={2}),
                      MaskedInput)


def test_a_peers_shares_are_read_from_it_only_when_delivered_as_it_sealed_them(
        round_seed: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    import meshkit_secagg._client as client_module

    opened: list[int] = []
    real = client_module.open_from

    def counted(private, sealed, seed, sender, recipient):  # type: ignore[no-untyped-def]
        opened.append(sender)
        return real(private, sealed, seed, sender, recipient)

    monkeypatch.setattr(client_module, "open_from", counted)
    clients, _, deliveries = _round(round_seed)
    peers = {c: clients[c] for c in (1, 2)}  # one party plays 0, 1 and 2
    helped, alone = copy.deepcopy(clients[0]), copy.deepcopy(clients[0])
    assert helped.open(deliveries[0], peers) == ()
    assert sorted(opened) == [3, 4, 5]  # the peers' shares were not decrypted
    assert alone.open(deliveries[0]) == ()
    assert helped._held == alone._held and len(helped._held) == 5
    # A peer's share altered on the way is decrypted, fails, and is an accusation as before.
    first = next(s for s in deliveries[0].shares if s.sender == 1)
    flipped = first.sealed[:-1] + bytes([first.sealed[-1] ^ 1])
    tampered = ShareDelivery(0, tuple(SealedShares(1, 0, flipped) if s.sender == 1 else s
                                      for s in deliveries[0].shares))
    assert copy.deepcopy(clients[0]).open(tampered, peers) == (1,)


def test_a_peers_share_sealed_to_another_key_is_decrypted_and_accused(round_seed: bytes) -> None:
    # The coordinator handed peer 1 a forged share key for client 0: what 1 sealed does not
    # open for 0, and reading it from 1 would hide that. It is decrypted, and accused.
    params = PARAMS
    clients = {c: ClientRound(params, c, round_seed, 16) for c in range(6)}
    adverts = {c: r.advertise() for c, r in clients.items()}
    forged = KeyAdvert(0, adverts[5].share_key, adverts[0].mask_key,
                       adverts[0].seed_commitment)
    server = ServerRound(params, range(6), round_seed, 16)
    for a in adverts.values():
        server.receive_advert(a)
    rosters = server.rosters()
    roster = rosters[1]
    rosters[1] = Roster(1, roster.members, tuple(forged if a.client == 0 else a
                                                 for a in roster.adverts))
    for c, r in rosters.items():
        server.receive_shares(clients[c].share(r))
    deliveries = server.deliveries()
    assert clients[0].open(deliveries[0], {1: clients[1]}) == (1,)
