"""A client written from the docs alone (tests/support/secagg_second_client.py) against the vectors and the plugin.

It reproduces every stored vector byte for byte, then plays clients in
rounds with the plugin's own ClientRound and ServerRound: the coordinator
unmasks the exact sum, whichever side drops.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import numpy as np
import pytest

from meshkit_secagg import (ClientRound, KeyAdvert, MaskedInput, SealedShares, SecAggParams,
                            ServerRound, ShareBundle, UnmaskReply, mask_vector)

from tests.support import secagg_second_client as second
from tests.support import secagg_vectors

STORED: dict[str, Any] = json.loads(secagg_vectors.PATH.read_text())


def test_the_second_client_reproduces_every_vector() -> None:
    seed = bytes.fromhex(STORED["round_seed"])
    members, p = STORED["members"], STORED["params"]
    clients = {u: second.SecondClient(u, seed, p, second.vector_draw) for u in members}
    adverts = {u: c.advert() for u, c in clients.items()}
    assert {u: a.hex() for u, a in adverts.items()} == {
        u: STORED["clients"][str(u)]["advert"] for u in members}
    rows = [(u, v, row) for u in members for v, row in clients[u].share(members, adverts)]
    assert [(u, v, row.hex()) for u, v, row in rows] == [
        (r["sender"], r["recipient"], r["row"]) for r in STORED["sealed_rows"]]
    for v in members:
        assert clients[v].open([(u, row) for u, w, row in rows if w == v]) == []
    for u in members:
        mine = STORED["clients"][str(u)]
        assert second.mask_words(clients[u].seed, p["masked_length"], p["modulus_bits"]) \
            == mine["self_mask_words"]
        assert clients[u].mask(mine["update"]) == mine["masked_input"]
    for pair in STORED["pairwise"]:
        assert clients[pair["low"]].pairwise_seed(pair["high"]).hex() == pair["seed"]
        assert second.mask_words(bytes.fromhex(pair["seed"]), p["masked_length"],
                                 p["modulus_bits"]) == pair["mask_words"]
    replies = [{"holder": h, "owner": o, "kind": k, "share": s.hex()}
               for h in STORED["survivors"]
               for o, k, s in clients[h].unmask(STORED["survivors"], STORED["dropped"])]
    assert replies == STORED["unmask_rows"]


def test_the_chacha20_keystream_is_rfc_8439s() -> None:
    # RFC 8439 Appendix A.1, test vector #1: key 0, nonce 0, block counter 0.
    assert second.chacha20_keystream(bytes(32), 64).hex() == (
        "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
        "da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586")
    # ...and, over several blocks, OpenSSL's ChaCha20 with a 16-byte all-zero counter and nonce.
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
    key = bytes(range(32))
    expected = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor().update(bytes(200))
    assert second.chacha20_keystream(key, 200) == expected


def _round(second_ids: set[int], dropped: set[int], members: list[int], seed_value: int) -> None:
    params = SecAggParams(clients=len(members), degree=2, threshold=2, clip_range=1.0,
                          modulus_bits=32)
    length, bits = 6, params.modulus_bits
    round_seed = secrets.token_bytes(32)
    rng = np.random.default_rng(seed_value)
    updates = {u: rng.integers(0, params.levels + 1, size=length, dtype=np.uint32)
               for u in members}
    mapping = {"degree": params.degree, "threshold": params.threshold, "modulus_bits": bits}
    ours = {u: second.SecondClient(u, round_seed, mapping) for u in members if u in second_ids}
    theirs = {u: ClientRound(params, u, round_seed, length) for u in members
              if u not in second_ids}
    server = ServerRound(params, members, round_seed, length)
    for u in members:
        if u in ours:
            a = ours[u].advert()
            server.receive_advert(KeyAdvert(u, a[:32], a[32:64], a[64:]))
        else:
            server.receive_advert(theirs[u].advertise())
    for u, roster in server.rosters().items():
        if u in ours:
            adverts = {a.client: a.share_key + a.mask_key + a.seed_commitment
                       for a in roster.adverts}
            rows = ours[u].share(roster.members, adverts)
            server.receive_shares(ShareBundle(u, tuple(SealedShares(u, v, r) for v, r in rows)))
        else:
            server.receive_shares(theirs[u].share(roster))
    for v, delivery in server.deliveries().items():
        if v in ours:
            assert ours[v].open([(s.sender, s.sealed) for s in delivery.shares]) == []
            masked = MaskedInput(v, np.array(ours[v].mask(updates[v].tolist()), dtype=np.uint32))
        else:
            masked = theirs[v].mask(delivery, updates[v])
        if v not in dropped:
            server.receive_masked(masked)
    for h, request in server.unmask_requests().items():
        if h in ours:
            answer = ours[h].unmask(request.survivors, request.dropped)
            server.receive_unmask(UnmaskReply(h, tuple((o, s) for o, k, s in answer if k == 0),
                                              tuple((o, s) for o, k, s in answer if k == 1)))
        else:
            server.receive_unmask(theirs[h].unmask(request))
    result = server.finish()
    survivors = [u for u in members if u not in dropped]
    expected = [sum(int(updates[u][i]) for u in survivors) for i in range(length)]
    assert result.total.astype(np.uint64).tolist() == expected
    assert list(result.contributors) == survivors and set(result.dropped) == dropped


@pytest.mark.parametrize("second_ids, dropped", [
    ({1, 4, 6}, set()),          # alternate clients, nobody drops
    ({1, 4, 6}, {4}),            # a second client drops after sharing: its key is rebuilt
    ({0, 1}, {3}),               # a plugin client drops; the second clients cancel its masks
])
def test_the_second_client_takes_part_in_a_round_with_the_plugins_clients(
        second_ids: set[int], dropped: set[int]) -> None:
    _round(second_ids, dropped, [0, 1, 3, 4, 6, 9], seed_value=len(second_ids) + len(dropped))


def test_a_masked_input_is_what_the_docs_say() -> None:
    # The plugin's mask of a seed is the documented PRG's words, at both word widths.
    seed = secrets.token_bytes(32)
    for bits in (17, 32, 40, 64):
        assert mask_vector(seed, 9, bits).tolist() == second.mask_words(seed, 9, bits)


def test_a_tampered_row_is_an_accusation_not_a_share() -> None:
    seed = bytes.fromhex(STORED["round_seed"])
    p = STORED["params"]
    row = STORED["sealed_rows"][0]
    client = second.SecondClient(row["recipient"], seed, p, second.vector_draw)
    sealed = bytearray(bytes.fromhex(row["row"]))
    sealed[60] ^= 1
    assert client.open([(row["sender"], bytes(sealed))]) == [row["sender"]]
