"""A coordinator played by hand against real workers, free to lie (docs/secure-aggregation.md).

:class:`Driver` is rank 0 of one secure round, sending each ``secagg_*``
request itself to real :class:`~meshkit.train.Trainer` workers (every
message through the wire codec and the workers' schema checks), so a test
can substitute an advert, play a client's neighbours with clients of its
own, or tell survivors different sets. :func:`recover` is the red team's
attack: rebuild one client's quantised update from what the coordinator
gathered (the self-mask seed's shares from some survivors, the mask key's
from others), as a coordinator that equivocates would.

Worker keys are made here (:func:`node_keys`); the coordinator's own key
(:data:`Driver.own_key`) is never in a worker's roster.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from meshkit_secagg import Share, mask_vector, masked_length, shamir_combine, sub_mod
from meshkit_secagg._agreement import PAIRWISE, agree, derive

import meshkit
from meshkit.secure_aggregation import (
    Roster,
    add_mod,
    advert_message,
    choose,
    from_wire,
    sign,
    vector_dtype,
)
from meshkit.train import Signing, Trainer, round_params
from meshkit.train._protocol import decode, encode
from meshkit.train._worker.secure import update_vector, vector_keys
from meshkit.wire import NodeKey

SEED = bytes(range(32))
ROUND = 1


def node_keys(ranks: Sequence[int]) -> dict[int, NodeKey]:
    return {r: NodeKey(Ed25519PrivateKey.generate()) for r in ranks}


def task() -> Any:
    return meshkit.plugins.create("task", "synthetic", {"params": 6, "arrays": 1, "rows": 40})


class Driver:
    """Rank 0 of one secure round over ``workers`` (rank -> Trainer), rank r playing client r - 1.

    ``signed``: each worker has a node key; ``roster``: each worker also checks
    signatures against the workers' keys (a worker without one checks nothing).
    """

    def __init__(self, workers: int, *, roster: bool, threshold: Any = "auto") -> None:
        self.ranks = list(range(1, workers + 1))
        self.keys = node_keys(self.ranks)
        self.own_key = NodeKey(Ed25519PrivateKey.generate())
        self.roster = Roster(frozenset(k.public for k in self.keys.values()), "the test roster")
        self.workers = {r: Trainer(task()) for r in self.ranks}
        for rank, trainer in self.workers.items():
            trainer.secure.signing = Signing(self.keys[rank], self.roster if roster else None)
        self.choice = choose("secagg+", {"degree": 0, "threshold": threshold, "clip_range": 1.0})
        self.params = round_params(self.choice, workers)
        self.state = task().init_state(3)
        self.length = int(sum(self.state[k].size for k in vector_keys(self.state)))
        self.seq = 0
        self.adverts: dict[int, bytes] = {}
        self.signers: dict[int, bytes] = {}
        self.signatures: dict[int, bytes] = {}

    @staticmethod
    def client_of(rank: int) -> int:
        return rank - 1

    def ask(self, rank: int, request: Mapping[str, Any]) -> dict[str, Any]:
        """``request`` to ``rank`` through the wire codec; its reply, decoded."""
        self.seq += 1
        sent = decode(encode({**request, "seq": self.seq}))
        return decode(encode(self.workers[rank].handle(sent)))

    # -- the honest steps --------------------------------------------------------------

    def start(self) -> None:
        for rank in self.ranks:
            assert "error" not in self.ask(rank, {"op": "set_state", "state": self.state})
            reply = self.ask(rank, {
                "op": "secagg_keys", "round": ROUND, "clients": [self.client_of(rank)],
                "cohort": self.params.clients, "degree": self.params.degree,
                "threshold": self.params.threshold, "clip_range": self.params.clip_range,
                "modulus_bits": self.params.modulus_bits,
                "round_seed": np.frombuffer(SEED, np.uint8)[None, :], "length": self.length})
            client = self.client_of(rank)
            self.adverts[client] = bytes(reply["adverts"][0])
            self.signers[client] = bytes(reply["signer"][0])
            self.signatures[client] = bytes(reply["signatures"][0])

    def share(self, rank: int, adverts: Mapping[int, bytes], signers: Mapping[int, bytes],
              signatures: Mapping[int, bytes]) -> dict[str, Any]:
        members = sorted(adverts)
        return self.ask(rank, {"op": "secagg_share", "members": members,
                               "adverts": _rows([adverts[m] for m in members]),
                               "signers": _rows([signers[m] for m in members]),
                               "signatures": _rows([signatures[m] for m in members])})

    def open(self, rank: int, rows: Sequence[tuple[int, bytes]]) -> dict[str, Any]:
        client = self.client_of(rank)
        return self.ask(rank, {"op": "secagg_open", "clients": [client],
                               "senders": [s for s, _ in rows],
                               "recipients": [client] * len(rows),
                               "sealed": _rows([b for _, b in rows], 200)})

    def mask(self, rank: int) -> dict[str, Any]:
        return self.ask(rank, {"op": "secagg_mask", "clients": [self.client_of(rank)],
                               "seeds": [1000 + rank], "shards": len(self.ranks),
                               "excluded": []})

    def confirm(self, rank: int, survivors: Sequence[int],
                dropped: Sequence[int]) -> dict[str, Any]:
        return self.ask(rank, {"op": "secagg_confirm", "clients": [self.client_of(rank)],
                               "survivors": list(survivors), "dropped": list(dropped)})

    def unmask(self, rank: int, survivors: Sequence[int], dropped: Sequence[int],
               confirmations: Mapping[int, tuple[bytes, bytes]] | None) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if confirmations is not None:
            ids = sorted(confirmations)
            extra = {"confirmed": ids,
                     "confirm_signers": _rows([confirmations[c][0] for c in ids], 32),
                     "confirm_signatures": _rows([confirmations[c][1] for c in ids], 64)}
        return self.ask(rank, {"op": "secagg_unmask", "clients": [self.client_of(rank)],
                               "survivors": list(survivors), "dropped": list(dropped),
                               **extra})

    def honest_until_masked(self) -> tuple[dict[int, np.ndarray], dict[int, dict[int, bytes]]]:
        """Keys, shares, opening and masking, all honest: each client's masked vector, and
        each client's sealed rows as sent (recipient -> row)."""
        self.start()
        sealed: dict[int, dict[int, bytes]] = {}
        for rank in self.ranks:
            reply = self.share(rank, self.adverts, self.signers, self.signatures)
            assert "error" not in reply, reply
            sealed[self.client_of(rank)] = {int(r): bytes(row) for r, row in
                                            zip(reply["recipients"], reply["sealed"])}
        for rank in self.ranks:
            client = self.client_of(rank)
            rows = [(s, sealed[s][client]) for s in sorted(sealed) if client in sealed[s]]
            assert self.open(rank, rows)["senders"] == []
        vectors = {}
        for rank in self.ranks:
            reply = self.mask(rank)
            assert "error" not in reply, reply
            vectors[self.client_of(rank)] = from_wire(reply, self.params.modulus_bits)
        return vectors, sealed

    def own_advert_signature(self, client: int, advert: bytes) -> tuple[bytes, bytes]:
        """The coordinator's own (unadmitted) key's signature of ``advert`` for ``client``."""
        return (self.own_key.public,
                sign(self.own_key, advert_message(SEED, ROUND, client, advert)))

    def plaintext(self, rank: int) -> np.ndarray:
        """What client ``rank - 1`` masks, quantised, computed in the clear (the reference)."""
        trainer = Trainer(task())
        trainer.handle({"op": "set_state", "seq": 1, "state": dict(self.state)})
        reply = trainer.handle({"op": "fit", "seq": 2, "shard": self.client_of(rank),
                                "shards": len(self.ranks), "seed": 1000 + rank})
        update = update_vector(reply["state"], self.state, vector_keys(self.state))
        return self.choice.scheme.quantize(update, self.params)


def _rows(rows: Sequence[bytes], width: int | None = None) -> np.ndarray:
    width = width if width is not None else len(rows[0])
    return (np.frombuffer(b"".join(rows), np.uint8).reshape(len(rows), width) if rows
            else np.zeros((0, width), np.uint8))


def shares_of(reply: Mapping[str, Any], owner: int, kind: int) -> list[bytes]:
    """The ``kind`` shares (0: self-mask seed, 1: mask key) of ``owner`` in an unmask reply."""
    if "error" in reply:
        return []
    return [bytes(s) for o, k, s in zip(reply["owners"], reply["kinds"], reply["shares"])
            if int(o) == owner and int(k) == kind]


def recover(driver: Driver, target: int, masked: np.ndarray, seed_shares: Sequence[bytes],
            key_shares: Sequence[bytes], adverts: Mapping[int, bytes] | None = None
            ) -> np.ndarray | None:
    """The red team: ``target``'s quantised update from its masked input and threshold
    shares of both its secrets, or None when the shares do not rebuild both. ``adverts``:
    the ones ``target`` masked with (default: the honest clients')."""
    t, bits = driver.params.threshold, driver.params.modulus_bits
    try:
        self_seed = shamir_combine([Share.from_bytes(s) for s in seed_shares], t)
        mask_key = shamir_combine([Share.from_bytes(s) for s in key_shares], t)
    except ValueError:
        return None
    n = masked_length(driver.length)
    out = sub_mod(masked.astype(vector_dtype(bits)), mask_vector(self_seed, n, bits), bits)
    for other, advert in sorted((adverts or driver.adverts).items()):
        if other == target:
            continue
        pairwise = derive(agree(mask_key, advert[32:64]), SEED, PAIRWISE, target, other)
        words = mask_vector(pairwise, n, bits)
        out = sub_mod(out, words, bits) if other > target else add_mod(out, words, bits)
    return out[:driver.length]
