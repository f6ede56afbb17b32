"""The coordinator's round: the exact sum of the survivors, through dropouts, and nothing in part."""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshkit import ProtocolError, RefusedError
from meshkit_secagg import (ClientRound, MaskedInput, MaskedSum, SealedShares, SecAggError,
                            SecAggParams, ServerRound, ShareBundle, UnmaskReply, add_mod,
                            dequantize, neighbours, simulate_round)

Updates = Callable[[SecAggParams, int], dict[int, np.ndarray]]
Sum = Callable[[dict[int, np.ndarray], tuple[int, ...]], np.ndarray]

N = 30
SPARSE = SecAggParams(clients=N, degree=10, threshold=6, clip_range=1.0, modulus_bits=32)
COMPLETE = SecAggParams(clients=20, degree=0, threshold=8, clip_range=1.0, modulus_bits=40)


def _spread(seed: bytes, params: SecAggParams, count: int) -> list[int]:
    """``count`` clients whose loss leaves every client ``t`` surviving neighbours (greedy)."""
    graph = neighbours(seed, range(params.clients), params.degree)
    dropped: list[int] = []
    for candidate in range(params.clients):
        if len(dropped) == count:
            break
        gone = {*dropped, candidate}
        if all(len(set(near) - gone) >= params.threshold for near in graph.values()):
            dropped.append(candidate)
    assert len(dropped) == count, "the test's graph cannot lose that many"
    return dropped


@pytest.mark.parametrize("params", [SPARSE, COMPLETE], ids=["degree-10", "complete"])
@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.3])
def test_the_unmasked_sum_is_the_plaintext_fixed_point_sum_bit_for_bit(
        params: SecAggParams, fraction: float, updates: Updates, exact_sum: Sum,
        round_seed: bytes) -> None:
    ups = updates(params, 300)
    dropped = _spread(round_seed, params, round(fraction * params.clients))
    run = simulate_round(params, ups, round_seed, drop_after_masking=dropped)
    survivors = tuple(c for c in range(params.clients) if c not in dropped)
    assert run.result.contributors == survivors and run.result.dropped == tuple(sorted(dropped))
    assert np.array_equal(run.result.total.astype(np.uint64), exact_sum(ups, survivors))
    mean = dequantize(run.result.total, params, len(survivors)) / len(survivors)
    assert np.isfinite(mean).all() and np.abs(mean).max() < params.clip_range


def test_clients_lost_before_sharing_or_unmasking_leave_the_sum_exact(
        updates: Updates, exact_sum: Sum, round_seed: bytes) -> None:
    ups = updates(COMPLETE, 50)
    run = simulate_round(COMPLETE, ups, round_seed, drop_before_sharing=[3],
                         drop_after_masking=[4, 5], drop_before_unmasking=[6, 7])
    survivors = tuple(c for c in range(COMPLETE.clients) if c not in (3, 4, 5))
    assert run.result.contributors == survivors
    assert np.array_equal(run.result.total.astype(np.uint64), exact_sum(ups, survivors))


def test_a_relays_modular_sum_counts_as_its_clients_inputs(
        updates: Updates, exact_sum: Sum, round_seed: bytes) -> None:
    params = SecAggParams(clients=8, degree=0, threshold=4, clip_range=1.0, modulus_bits=24)
    ups = updates(params, 64)
    clients = {c: ClientRound(params, c, round_seed, 64) for c in range(8)}
    server = ServerRound(params, range(8), round_seed, 64)
    for c in clients.values():
        server.receive_advert(c.advertise())
    for c, roster in server.rosters().items():
        server.receive_shares(clients[c].share(roster))
    masked = {c: clients[c].mask(d, ups[c]) for c, d in server.deliveries().items()}
    relay = masked[0].vector.copy()
    for c in (1, 2, 3):
        add_mod(relay, masked[c].vector, 24, out=relay)
    server.receive_masked(MaskedSum((0, 1, 2, 3), relay))
    for c in (4, 5, 6):
        server.receive_masked(masked[c])
    for c, request in server.unmask_requests().items():
        server.receive_unmask(clients[c].unmask(request))
    result = server.finish()
    assert result.contributors == (0, 1, 2, 3, 4, 5, 6) and result.dropped == (7,)
    assert np.array_equal(result.total.astype(np.uint64), exact_sum(ups, result.contributors))


def _masked_stage(params: SecAggParams, ups: dict[int, np.ndarray], seed: bytes,
                  groups: dict[int, int] | None = None):
    clients = {c: ClientRound(params, c, seed, len(ups[0])) for c in ups}
    server = ServerRound(params, list(ups), seed, len(ups[0]), groups=groups)
    for c in clients.values():
        server.receive_advert(c.advertise())
    for c, roster in server.rosters().items():
        server.receive_shares(clients[c].share(roster))
    masked = {c: clients[c].mask(d, ups[c]) for c, d in server.deliveries().items()}
    return clients, server, masked


def test_fewer_than_threshold_survivors_are_refused_before_any_share_is_asked_for(
        updates: Updates, round_seed: bytes) -> None:
    params = SecAggParams(clients=10, degree=0, threshold=6, clip_range=1.0)
    clients, server, masked = _masked_stage(params, updates(params, 16), round_seed)
    for c in range(5):
        server.receive_masked(masked[c])
    with pytest.raises(RefusedError, match="5 clients sent masked input, fewer than the threshold 6"):
        server.unmask_requests()
    with pytest.raises(RuntimeError, match="out of order"):
        server.finish()  # the round is over: nothing to unmask


def test_too_few_unmasking_shares_refuse_the_whole_sum(updates: Updates, round_seed: bytes) -> None:
    params = SecAggParams(clients=10, degree=0, threshold=6, clip_range=1.0)
    clients, server, masked = _masked_stage(params, updates(params, 16), round_seed)
    for c in range(8):
        server.receive_masked(masked[c])
    requests = server.unmask_requests()
    for c in range(5):  # 5 replies: every secret has 5 shares, one short
        server.receive_unmask(clients[c].unmask(requests[c]))
    with pytest.raises(RefusedError, match="fewer than 6 shares among the 5 replies"):
        server.finish()


def test_a_wrong_share_is_pinned_on_its_holder_and_the_sum_survives_without_it(
        updates: Updates, exact_sum: Sum, round_seed: bytes) -> None:
    params = SecAggParams(clients=10, degree=0, threshold=5, clip_range=1.0)
    ups = updates(params, 16)
    clients, server, masked = _masked_stage(params, ups, round_seed)
    for c in range(9):
        server.receive_masked(masked[c])
    requests = server.unmask_requests()
    for c in range(9):
        reply = clients[c].unmask(requests[c])
        if c == 0:  # holder 0 lies about its share of client 1's self-mask seed
            owner, share = reply.seed_shares[0]
            bad = share[:-1] + bytes([share[-1] ^ 1])
            reply = UnmaskReply(0, ((owner, bad), *reply.seed_shares[1:]), reply.key_shares)
        server.receive_unmask(reply)
    with pytest.raises(SecAggError) as caught:
        server.finish()
    assert caught.value.client == 0 and isinstance(caught.value, ProtocolError)
    result = server.finish()  # holder 0's reply is discarded: 8 replies are plenty
    assert np.array_equal(result.total.astype(np.uint64), exact_sum(ups, tuple(range(9))))


def _lie(reply: UnmaskReply, owner: int) -> UnmaskReply:
    """``reply`` with its share of ``owner``'s self-mask seed altered."""
    shares = tuple((o, s[:-1] + bytes([s[-1] ^ 1]) if o == owner else s)
                   for o, s in reply.seed_shares)
    return UnmaskReply(reply.client, shares, reply.key_shares)


def test_a_party_playing_two_holders_with_bad_shares_is_left_out_whole(
        updates: Updates, exact_sum: Sum, round_seed: bytes) -> None:
    # Clients 0 and 1 are one worker's (party 7): both lie about client 5's seed. Leaving
    # out one holder at a time never mends the secret; leaving out the party does.
    params = SecAggParams(clients=10, degree=0, threshold=5, clip_range=1.0)
    ups = updates(params, 16)
    groups = {c: 7 if c < 2 else 100 + c for c in range(10)}
    clients, server, masked = _masked_stage(params, ups, round_seed, groups)
    for c in range(10):
        server.receive_masked(masked[c])
    for c, request in server.unmask_requests().items():
        reply = clients[c].unmask(request)
        server.receive_unmask(_lie(reply, 5) if c < 2 else reply)
    with pytest.raises(SecAggError, match=r"held by clients \[0, 1\] \(played by party 7\)") \
            as caught:
        server.finish()
    assert caught.value.client == 0
    result = server.finish()  # both replies discarded: eight are plenty for t = 5
    assert np.array_equal(result.total.astype(np.uint64), exact_sum(ups, tuple(range(10))))


def test_a_bad_message_is_blamed_on_its_client_and_changes_nothing(
        updates: Updates, exact_sum: Sum, round_seed: bytes) -> None:
    params = SecAggParams(clients=6, degree=0, threshold=3, clip_range=1.0, modulus_bits=20)
    ups = updates(params, 32)
    clients, server, masked = _masked_stage(params, ups, round_seed)
    wrong = [MaskedInput(1, masked[1].vector[:-1]),                       # short
             MaskedInput(1, masked[1].vector.astype(np.uint64)),          # wrong dtype
             MaskedInput(1, masked[1].vector | np.uint32(1 << 25)),       # beyond 2**20
             MaskedInput(9, masked[1].vector)]                            # not in the round
    for message in wrong:
        with pytest.raises(SecAggError) as caught:
            server.receive_masked(message)
        assert caught.value.client == message.client
    for c in range(6):
        server.receive_masked(masked[c])
    with pytest.raises(SecAggError, match="sent one already"):
        server.receive_masked(masked[2])
    for c, request in server.unmask_requests().items():
        server.receive_unmask(clients[c].unmask(request))
    assert np.array_equal(server.finish().total.astype(np.uint64), exact_sum(ups, tuple(range(6))))


def test_a_client_sealing_shares_for_strangers_is_refused(round_seed: bytes) -> None:
    params = SecAggParams(clients=12, degree=4, threshold=3, clip_range=1.0)
    clients = {c: ClientRound(params, c, round_seed, 8) for c in range(12)}
    server = ServerRound(params, range(12), round_seed, 8)
    for c in clients.values():
        server.receive_advert(c.advertise())
    rosters = server.rosters()
    bundle = clients[0].share(rosters[0])
    stranger = next(c for c in range(1, 12) if all(a.client != c for a in rosters[0].adverts))
    forged = type(bundle)(0, tuple(sorted(
        [*bundle.shares[1:], type(bundle.shares[0])(0, stranger, bundle.shares[0].sealed)],
        key=lambda s: s.recipient)))
    with pytest.raises(SecAggError, match="not for its neighbours") as caught:
        server.receive_shares(forged)
    assert caught.value.client == 0
    server.receive_shares(bundle)


def test_a_key_advertised_twice_is_refused(round_seed: bytes) -> None:
    params = SecAggParams(clients=4, degree=0, threshold=2, clip_range=1.0, modulus_bits=20)
    a, b = ClientRound(params, 0, round_seed, 4), ClientRound(params, 1, round_seed, 4)
    server = ServerRound(params, range(4), round_seed, 4)
    first = a.advertise()
    server.receive_advert(first)
    with pytest.raises(SecAggError, match="second key advert"):
        server.receive_advert(first)
    copy = type(first)(1, first.share_key, b.advertise().mask_key, first.seed_commitment)
    with pytest.raises(SecAggError, match="advertised already") as caught:
        server.receive_advert(copy)
    assert caught.value.client == 1


def test_the_coordinator_never_holds_an_individual_unmasked_update(
        monkeypatch: pytest.MonkeyPatch, updates: Updates, exact_sum: Sum,
        round_seed: bytes) -> None:
    # Every vector the coordinator's arithmetic takes in or gives out, recorded.
    import meshkit_secagg._server as server_module
    seen: list[np.ndarray] = []

    def recording(function):
        def wrapped(*args, **kwargs):
            result = function(*args, **kwargs)
            seen.extend(np.array(a, copy=True) for a in (*args[:2], result)
                        if isinstance(a, np.ndarray))
            return result
        return wrapped

    for name in ("add_mod", "sub_mod", "mask_vector"):
        monkeypatch.setattr(server_module, name, recording(getattr(server_module, name)))
    params = SecAggParams(clients=8, degree=4, threshold=3, clip_range=1.0, modulus_bits=32)
    ups = updates(params, 256)
    run = simulate_round(params, ups, round_seed, drop_after_masking=[5])
    assert np.array_equal(run.result.total.astype(np.uint64), exact_sum(ups, run.result.contributors))
    assert len(seen) > 30
    for vector in seen:
        assert not any(np.array_equal(vector, update) for update in ups.values())


def test_a_small_order_public_key_is_refused_when_advertised(round_seed: bytes) -> None:
    # Such a key agrees to zero with everyone: a pairwise seed anyone can compute.
    params = SecAggParams(clients=4, degree=0, threshold=2, clip_range=1.0, modulus_bits=20)
    honest = ClientRound(params, 0, round_seed, 4).advertise()
    server = ServerRound(params, range(4), round_seed, 4)
    with pytest.raises(SecAggError, match="mask key") as caught:
        server.receive_advert(type(honest)(0, honest.share_key, bytes(32), honest.seed_commitment))
    assert caught.value.client == 0
    server.receive_advert(honest)


def test_a_relays_sum_naming_a_stranger_is_blamed_on_no_client(round_seed: bytes) -> None:
    params = SecAggParams(clients=4, degree=0, threshold=2, clip_range=1.0, modulus_bits=20)
    ups = {c: np.zeros(4, np.uint32) for c in range(4)}
    clients, server, masked = _masked_stage(params, ups, round_seed)
    with pytest.raises(SecAggError, match="did not share") as caught:
        server.receive_masked(MaskedSum((0, 9), masked[0].vector))
    assert caught.value.client is None  # the relay's fault: the engine names its rank
    server.receive_masked(masked[0])


@settings(max_examples=15, deadline=None, derandomize=True)
@given(drops=st.lists(st.sampled_from(["stay"] * 9 + ["before sharing", "after masking",
                                       "before unmasking"]), min_size=10, max_size=10))
def test_whoever_drops_when_the_sum_is_exact_or_refused(drops: list[str]) -> None:
    # About half of these rounds keep enough neighbours to unmask, half refuse.
    params = SecAggParams(clients=10, degree=6, threshold=4, clip_range=1.0, modulus_bits=24)
    ups = {c: np.full(8, c + 1, np.uint32) for c in range(10)}
    at = {stage: [c for c, d in enumerate(drops) if d == stage] for stage in set(drops)}
    try:
        run = simulate_round(params, ups, b"any dropouts",
                             drop_before_sharing=at.get("before sharing", []),
                             drop_after_masking=at.get("after masking", []),
                             drop_before_unmasking=at.get("before unmasking", []))
    except RefusedError:
        return
    gone = set(at.get("before sharing", [])) | set(at.get("after masking", []))
    assert not set(run.result.contributors) & gone
    assert run.result.total.tolist() == [sum(c + 1 for c in run.result.contributors)] * 8


@pytest.mark.parametrize("listed,added", [((0, 1), (0, 1, 2)), ((0, 1, 2), (0, 1))],
                         ids=["a client added but not listed", "a client listed but not added"])
def test_a_sum_counted_under_the_wrong_clients_fails_its_check_and_is_not_released(
        listed: tuple[int, ...], added: tuple[int, ...], round_seed: bytes) -> None:
    params = SecAggParams(clients=6, degree=0, threshold=3, clip_range=1.0, modulus_bits=32)
    ups = {c: np.full(5, 10 + c, np.uint32) for c in range(6)}
    clients, server, masked = _masked_stage(params, ups, round_seed)
    relay = masked[added[0]].vector.copy()
    for c in added[1:]:
        add_mod(relay, masked[c].vector, 32, out=relay)
    server.receive_masked(MaskedSum(listed, relay))  # the relay misreports whom it added
    for c in (3, 4, 5):
        server.receive_masked(masked[c])
    for c, request in server.unmask_requests().items():
        server.receive_unmask(clients[c].unmask(request))
    with pytest.raises(RefusedError, match="fails its count check"):
        server.finish()


def test_the_result_carries_the_update_only(updates: Updates, round_seed: bytes) -> None:
    params = SecAggParams(clients=4, degree=0, threshold=2, clip_range=1.0, modulus_bits=32)
    run = simulate_round(params, updates(params, 7), round_seed)
    assert run.result.total.shape == (7,)


def test_an_accusation_is_settled_from_the_sealers_revealed_key_not_anyones_word(
        updates: Updates, exact_sum: Sum, round_seed: bytes) -> None:
    params = SecAggParams(clients=6, degree=0, threshold=3, clip_range=1.0, modulus_bits=32)
    ups = updates(params, 16)
    clients = {c: ClientRound(params, c, round_seed, 16) for c in ups}
    server = ServerRound(params, list(ups), round_seed, 16)
    for c in clients.values():
        server.receive_advert(c.advertise())
    for c, roster in server.rosters().items():
        bundle = clients[c].share(roster)
        if c == 1:  # client 1 seals garbage to client 0 (with its own ephemeral key)
            row = bundle.shares[0]
            garbage = row.sealed[:32] + bytes(len(row.sealed) - 32)
            bundle = ShareBundle(1, (SealedShares(1, 0, garbage), *bundle.shares[1:]))
        server.receive_shares(bundle)
    deliveries = server.deliveries()
    accused = {c: clients[c].open(d) for c, d in deliveries.items()}
    assert accused == {0: (1,), 1: (), 2: (), 3: (), 4: (), 5: ()}
    # A false accusation (client 2 says client 3's sound shares did not open) is the
    # accuser's; a key that is not the row's, or none, is the sealer's.
    assert server.judge(3, 2, clients[3].reveal(2)) == 2
    assert server.judge(1, 0, clients[1].reveal(2)) == 1
    assert server.judge(1, 0, None) == 1
    assert server.judge(1, 0, clients[1].reveal(0)) == 1
    assert server.exclude([1]) == (1,)
    for c in (0, 2, 3, 4, 5):
        server.receive_masked(clients[c].mask_opened(ups[c], excluded=[1]))
    for c, request in server.unmask_requests().items():
        server.receive_unmask(clients[c].unmask(request))
    result = server.finish()
    assert result.contributors == (0, 2, 3, 4, 5) and result.dropped == ()
    assert np.array_equal(result.total.astype(np.uint64), exact_sum(ups, (0, 2, 3, 4, 5)))
