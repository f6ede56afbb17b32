"""The secure round's test vectors, computed from the plugin's own functions (docs/protocol.md §7.2.1).

One SecAgg+ round of five clients with every random draw fixed by
:func:`draw` (the rule the vectors file states), every intermediate
recorded: keys, commitments, the graph's ring keys, Shamir polynomials and
shares, each sealed row and what went into it, pairwise seeds, the first
mask words, the masked inputs, the unmasking rows and the sum.

``python -m tests.support.secagg_vectors`` rewrites
``tests/plugins/meshkit_secagg/vectors/round.json``; the drift test
(tests/plugins/meshkit_secagg/test_vectors.py) fails when :func:`compute`
no longer gives the stored file, i.e. when a byte on the wire changed.
The plugin's randomness is fixed by replacing its two sources for the
duration: ``secrets.randbelow`` in ``_shamir`` (polynomial coefficients)
and ``os.urandom`` in ``_agreement`` (AES-GCM nonces); keys and seeds are
passed in, never drawn by the plugin here.
"""

from __future__ import annotations

import hashlib
import json
import types
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

from meshkit_secagg import (PRIME, SecAggParams, add_mod, mask_vector, masked_length,
                            neighbours, shamir_split, sub_mod)
from meshkit_secagg import _agreement, _shamir
from meshkit_secagg._agreement import (PAIRWISE, SEALING, agree, derive, public_key, seal,
                                       seed_commitment)

PATH = Path(__file__).resolve().parents[1] / "plugins" / "meshkit_secagg" / "vectors" / "round.json"

IDS = (1, 2, 3, 5, 8)
DROPPED = (8,)  # shares, then its masked input never arrives
LENGTH = 3
PARAMS = SecAggParams(clients=5, degree=2, threshold=2, clip_range=1.0, modulus_bits=24)
RULE = ("draw(label, size) = SHA-512(b'meshkit/secagg/vectors ' + label)[:size]; "
        "id8(i) = i as 8 bytes big-endian signed; round seed: draw(b'round seed', 32); "
        "client u: share key draw(b'share key ' + id8(u), 32), mask key draw(b'mask key ' + "
        "id8(u), 32), self-mask seed draw(b'self-mask seed ' + id8(u), 32); its polynomials' "
        "coefficient j (1 to t-1): int(draw(b'coefficient ' + kind + b' ' + id8(u) + j as 4 "
        "bytes big-endian, 64), big-endian) mod p, kind b'seed' or b'key'; its row to v: "
        "ephemeral key draw(b'ephemeral ' + id8(u) + id8(v), 32), nonce draw(b'nonce ' + "
        "id8(u) + id8(v), 12); update of u: [1000 u + i for i in 0..length-1]")


def draw(label: bytes, size: int) -> bytes:
    return hashlib.sha512(b"meshkit/secagg/vectors " + label).digest()[:size]


def id8(value: int) -> bytes:
    return value.to_bytes(8, "big", signed=True)


def coefficient(kind: bytes, client: int, j: int) -> int:
    return int.from_bytes(draw(b"coefficient " + kind + b" " + id8(client) + j.to_bytes(4, "big"),
                               64), "big") % PRIME


class _Fixed:
    """Hands out queued values in place of a randomness source's."""

    def __init__(self) -> None:
        self.queue: list[Any] = []

    def take(self, *_: Any) -> Any:
        if not self.queue:
            raise AssertionError("the plugin drew more randomness than the vectors fix: has its "
                                 "use of secrets.randbelow / os.urandom changed?")
        return self.queue.pop(0)


def _fixed_randomness() -> tuple[_Fixed, _Fixed, list[Any]]:
    coefficients, nonces = _Fixed(), _Fixed()
    patches = [mock.patch.object(_shamir, "_secrets",
                                 types.SimpleNamespace(randbelow=coefficients.take)),
               mock.patch.object(_agreement, "os", types.SimpleNamespace(urandom=nonces.take))]
    return coefficients, nonces, patches


def compute() -> dict[str, Any]:
    """Every intermediate of the vectors' round, from the plugin's code."""
    bits, t, size = PARAMS.modulus_bits, PARAMS.threshold, masked_length(LENGTH)
    round_seed = draw(b"round seed", 32)
    graph = neighbours(round_seed, IDS, PARAMS.degree)
    coefficients, nonces, patches = _fixed_randomness()
    clients: dict[str, dict[str, Any]] = {}
    secrets_of: dict[int, dict[str, bytes]] = {}
    shares_of: dict[int, dict[str, dict[int, bytes]]] = {}
    for u in IDS:
        mine = {"share": draw(b"share key " + id8(u), 32), "mask": draw(b"mask key " + id8(u), 32),
                "seed": draw(b"self-mask seed " + id8(u), 32)}
        secrets_of[u] = mine
        xs = [v + 1 for v in graph[u]] + [u + 1]
        split: dict[str, dict[int, bytes]] = {}
        record: dict[str, Any] = {}
        for kind, secret in (("seed", mine["seed"]), ("key", mine["mask"])):
            coefficients.queue = [coefficient(kind.encode(), u, j) for j in range(1, t)]
            with patches[0]:
                shares = shamir_split(secret, t, xs)
            assert not coefficients.queue
            record[f"{kind}_coefficients"] = [hex(c) for c in
                                              [coefficient(kind.encode(), u, j) for j in range(1, t)]]
            split[kind] = {s.x - 1: s.to_bytes() for s in shares}
            record[f"{kind}_shares"] = {str(h): b.hex() for h, b in split[kind].items()}
        shares_of[u] = split
        commit = seed_commitment(mine["seed"], round_seed, u)
        advert = public_key(mine["share"]) + public_key(mine["mask"]) + commit
        update = [1000 * u + i for i in range(LENGTH)]
        clients[str(u)] = {
            "share_private": mine["share"].hex(), "share_public": public_key(mine["share"]).hex(),
            "mask_private": mine["mask"].hex(), "mask_public": public_key(mine["mask"]).hex(),
            "self_mask_seed": mine["seed"].hex(), "seed_commitment": commit.hex(),
            "advert": advert.hex(),
            "ring_key": hashlib.sha256(b"meshkit/secagg graph " + round_seed + id8(u)).hexdigest(),
            "neighbours": list(graph[u]), **record, "update": update,
            "self_mask_words": [int(w) for w in mask_vector(mine["seed"], size, bits)]}
    sealed = []
    for u in IDS:
        for v in graph[u]:
            ephemeral = draw(b"ephemeral " + id8(u) + id8(v), 32)
            nonce = draw(b"nonce " + id8(u) + id8(v), 12)
            shared = agree(ephemeral, public_key(secrets_of[v]["share"]))
            key = derive(shared, round_seed, SEALING, u, v)
            plaintext = shares_of[u]["seed"][v] + shares_of[u]["key"][v]
            nonces.queue = [nonce]
            with patches[1]:
                body = seal(key, plaintext, round_seed, u, v)
            assert not nonces.queue
            sealed.append({"sender": u, "recipient": v, "ephemeral_private": ephemeral.hex(),
                           "ephemeral_public": public_key(ephemeral).hex(),
                           "agreement": shared.hex(), "sealing_key": key.hex(),
                           "nonce": nonce.hex(), "plaintext": plaintext.hex(),
                           "row": (public_key(ephemeral) + body).hex()})
    pairwise, seeds = [], {}
    for u in IDS:
        for v in graph[u]:
            if u < v:
                shared = agree(secrets_of[u]["mask"], public_key(secrets_of[v]["mask"]))
                seed = derive(shared, round_seed, PAIRWISE, u, v)
                seeds[u, v] = seeds[v, u] = seed
                pairwise.append({"low": u, "high": v, "agreement": shared.hex(),
                                 "seed": seed.hex(),
                                 "mask_words": [int(w) for w in mask_vector(seed, size, bits)]})
    dtype = np.uint32 if bits <= 32 else np.uint64
    survivors = [u for u in IDS if u not in DROPPED]
    total = np.zeros(size, dtype=dtype)
    for u in IDS:
        vector = np.array(clients[str(u)]["update"] + [1, 1], dtype=dtype)
        add_mod(vector, mask_vector(secrets_of[u]["seed"], size, bits), bits, out=vector)
        for v in graph[u]:
            (add_mod if u < v else sub_mod)(vector, mask_vector(seeds[u, v], size, bits), bits,
                                            out=vector)
        clients[str(u)]["masked_input"] = [int(w) for w in vector]
        if u in survivors:
            add_mod(total, vector, bits, out=total)
    unmask = []
    for h in survivors:
        held = [o for o in IDS if h in graph[o] or o == h]
        unmask += [{"holder": h, "owner": o, "kind": 0, "share": shares_of[o]["seed"][h].hex()}
                   for o in held if o in survivors]
        unmask += [{"holder": h, "owner": o, "kind": 1, "share": shares_of[o]["key"][h].hex()}
                   for o in held if o in DROPPED and o != h]
    exact = [sum(clients[str(u)]["update"][i] for u in survivors) for i in range(LENGTH)]
    return {
        "about": "docs/protocol.md §7.2.1: one SecAgg+ round, every byte; hex strings are bytes, "
                 "lists of ints are mod 2**modulus_bits words",
        "rule": RULE,
        "params": {"clients": PARAMS.clients, "degree": PARAMS.degree, "threshold": t,
                   "clip_range": PARAMS.clip_range, "modulus_bits": bits, "length": LENGTH,
                   "masked_length": size},
        "members": list(IDS), "survivors": survivors, "dropped": list(DROPPED),
        "round_seed": round_seed.hex(), "clients": clients, "sealed_rows": sealed,
        "pairwise": pairwise, "unmask_rows": unmask,
        "masked_sum": [int(w) for w in total], "sum": exact + [len(survivors)] * 2,
    }


def main() -> None:
    PATH.parent.mkdir(parents=True, exist_ok=True)
    PATH.write_text(json.dumps(compute(), indent=1) + "\n")
    print(f"wrote {PATH}")


if __name__ == "__main__":
    main()
