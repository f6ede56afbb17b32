"""The secure round's test vectors (docs/protocol.md §7.2.1) against the plugin's code.

The drift test recomputes every vector from the plugin's functions and fails
on any change: a byte of a key derivation, a commitment, a share, a sealed
row or a mask word that moves changes the wire, and a peer written from the
docs would no longer interoperate. If the change is meant, it is a protocol
change: regenerate (``python -m tests.support.secagg_vectors``) and update
docs/protocol.md in the same commit.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from meshkit_secagg import (KeyAdvert, MaskedInput, SealedShares, ServerRound, Share,
                            ShareBundle, UnmaskReply, neighbours, shamir_combine)
from meshkit_secagg._agreement import open_from, open_revealed

from tests.support import secagg_vectors

STORED: dict[str, Any] = json.loads(secagg_vectors.PATH.read_text())


def _differences(stored: Any, computed: Any, path: str = "") -> list[str]:
    if isinstance(stored, dict) and isinstance(computed, dict):
        keys = sorted(set(stored) | set(computed))
        return [d for k in keys for d in _differences(stored.get(k), computed.get(k),
                                                      f"{path}.{k}")]
    if isinstance(stored, list) and isinstance(computed, list) and len(stored) == len(computed):
        return [d for i, (a, b) in enumerate(zip(stored, computed))
                for d in _differences(a, b, f"{path}[{i}]")]
    return [] if stored == computed else [f"{path}: stored {stored!r}, code gives {computed!r}"]


def test_the_code_still_computes_every_stored_vector() -> None:
    differences = _differences(STORED, secagg_vectors.compute())
    assert not differences, ("the secure round's bytes changed (a wire change: see this module's "
                             "docstring):\n" + "\n".join(differences[:20]))


def test_the_drift_test_sees_a_changed_byte() -> None:
    changed = json.loads(json.dumps(STORED))
    row = changed["sealed_rows"][0]["row"]
    changed["sealed_rows"][0]["row"] = row[:-2] + ("00" if row[-2:] != "00" else "01")
    assert _differences(changed, secagg_vectors.compute()) == [
        f".sealed_rows[0].row: stored {changed['sealed_rows'][0]['row']!r}, code gives {row!r}"]


def _client(u: int) -> dict[str, Any]:
    return STORED["clients"][str(u)]


@pytest.mark.parametrize("index", range(len(STORED["sealed_rows"])))
def test_each_sealed_row_opens_for_its_recipient_and_with_its_revealed_key(index: int) -> None:
    row = STORED["sealed_rows"][index]
    seed = bytes.fromhex(STORED["round_seed"])
    sealed, plain = bytes.fromhex(row["row"]), bytes.fromhex(row["plaintext"])
    u, v = row["sender"], row["recipient"]
    assert open_from(bytes.fromhex(_client(v)["share_private"]), sealed, seed, u, v) == plain
    assert open_revealed(bytes.fromhex(row["ephemeral_private"]),
                         bytes.fromhex(_client(v)["share_public"]), sealed, seed, u, v) == plain
    with pytest.raises(ValueError):  # bound to the pair: the swapped direction does not open
        open_from(bytes.fromhex(_client(v)["share_private"]), sealed, seed, v, u)


@pytest.mark.parametrize("u", STORED["members"])
def test_any_threshold_of_a_clients_shares_rebuilds_its_secrets(u: int) -> None:
    t = STORED["params"]["threshold"]
    for kind, secret in (("seed", "self_mask_seed"), ("key", "mask_private")):
        shares = [Share.from_bytes(bytes.fromhex(h)) for h in _client(u)[f"{kind}_shares"].values()]
        for start in range(len(shares) - t + 1):
            assert shamir_combine(shares[start:start + t], t).hex() == _client(u)[secret]


def test_the_graph_is_the_harary_ring_of_the_stored_ring_keys() -> None:
    members, degree = STORED["members"], STORED["params"]["degree"]
    ring = sorted(members, key=lambda m: (bytes.fromhex(_client(m)["ring_key"]), m))
    half, n = (degree + degree % 2) // 2, len(ring)
    expected = {m: tuple(sorted({ring[(i + s) % n] for s in range(-half, half + 1) if s}))
                for i, m in enumerate(ring)}
    assert neighbours(bytes.fromhex(STORED["round_seed"]), members, degree) == expected
    assert {m: tuple(_client(m)["neighbours"]) for m in members} == expected


def test_the_plugins_coordinator_unmasks_the_stored_round_to_its_sum() -> None:
    p = STORED["params"]
    params = secagg_vectors.PARAMS
    seed = bytes.fromhex(STORED["round_seed"])
    server = ServerRound(params, STORED["members"], seed, p["length"])
    for u in STORED["members"]:
        advert = bytes.fromhex(_client(u)["advert"])
        server.receive_advert(KeyAdvert(u, advert[:32], advert[32:64], advert[64:]))
    rosters = server.rosters()
    for u in STORED["members"]:
        assert [a.client for a in rosters[u].adverts] == _client(u)["neighbours"]
        rows = tuple(SealedShares(r["sender"], r["recipient"], bytes.fromhex(r["row"]))
                     for r in STORED["sealed_rows"] if r["sender"] == u)
        server.receive_shares(ShareBundle(u, rows))
    deliveries = server.deliveries()
    for v in STORED["members"]:
        assert [(s.sender, s.sealed.hex()) for s in deliveries[v].shares] == [
            (r["sender"], r["row"]) for r in STORED["sealed_rows"] if r["recipient"] == v]
    dtype = np.uint32 if p["modulus_bits"] <= 32 else np.uint64
    for u in STORED["survivors"]:
        server.receive_masked(MaskedInput(u, np.array(_client(u)["masked_input"], dtype=dtype)))
    for h, request in server.unmask_requests().items():
        assert (list(request.survivors), list(request.dropped)) == (STORED["survivors"],
                                                                    STORED["dropped"])
        mine = [r for r in STORED["unmask_rows"] if r["holder"] == h]
        server.receive_unmask(UnmaskReply(
            h, tuple((r["owner"], bytes.fromhex(r["share"])) for r in mine if r["kind"] == 0),
            tuple((r["owner"], bytes.fromhex(r["share"])) for r in mine if r["kind"] == 1)))
    result = server.finish()
    assert result.total.tolist() == STORED["sum"][:p["length"]]
    assert list(result.contributors) == STORED["survivors"]
    assert list(result.dropped) == STORED["dropped"]
