"""Signed rounds: node keys sign each client's advert and the survivor set it was told.

Rule: every byte a signed round signs is laid out here (docs/protocol.md
§7.2.2), and every check of a signature against the roster is made here, so
a scheme plugin gets both without knowing them: the kernel signs a scheme's
advert *row* (whatever its bytes) and a survivor set (client ids), never a
scheme's secret.

Against a coordinator that lies (docs/secure-aggregation.md, "Threat
model"), two checks, after Bonawitz et al. 2017 §6 (the malicious model):

* **signed adverts** (:func:`advert_message`): the worker playing a client
  signs its advert with its node key (``meshkit keygen``, ``meshkit node
  --key``); a worker with a roster (``meshkit node --roster FILE``, the
  ``[mesh] authorized_nodes`` format) checks every member's advert before
  its clients share a secret, and refuses the round
  (:class:`SignatureError`) when one is unsigned, signed by a key not in the
  roster (or revoked), or signed over other bytes: the coordinator cannot
  put keys of its own in place of a client's, nor play a client's
  neighbours, without an admitted node key.
* **the consistency check** (:func:`confirm_message`, ``secagg_confirm``):
  before unmasking, each survivor signs the survivor and dropped sets it was
  told; the unmask request carries the confirmations the coordinator
  collected; a client reveals shares only when at least ``threshold``
  survivors, and more than half of the clients the sets name (survivors
  and dropped), confirmed *exactly the sets it was told* (its own
  confirmation counted), each signed by the key that signed that client's
  advert (:func:`check_confirmations`), else :class:`EquivocationError`.
  Two sets confirmed by majorities share an honest client, who confirms
  one pair of sets only: without colluding clients, the coordinator cannot
  have two groups of survivors reveal on two different sets.

Byte layout (big-endian; ``id8`` a client id as 8 bytes, as §7.2.1)::

    advert  = "meshkit/secagg/1 signed advert " || seed || u64(round) || id8(client)
              || u32(len(row)) || row
    confirm = "meshkit/secagg/1 survivor confirmation " || seed || u64(round)
              || id8(client) || u32(len(S)) || id8(s)... || u32(len(D)) || id8(d)...

(``S`` the survivors, ``D`` the dropped, each ascending.) A signature is
Ed25519 (RFC 8032) over that message, 64 bytes; the signer's public key is
32 raw bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence

import attrs
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from meshkit.errors import RefusedError
from meshkit.secure_aggregation._contract import SecureAggregationError
from meshkit.wire import AuthorizedNodes, NodeKey, fingerprint

__all__ = [
    "ADVERT_LABEL",
    "CONFIRM_LABEL",
    "PUBLIC_SIZE",
    "SIGNATURE_SIZE",
    "EquivocationError",
    "Roster",
    "SignatureError",
    "advert_message",
    "check_adverts",
    "check_confirmations",
    "confirm_message",
    "confirm_messages",
    "sign",
    "verify",
]

ADVERT_LABEL = b"meshkit/secagg/1 signed advert "
CONFIRM_LABEL = b"meshkit/secagg/1 survivor confirmation "
#: Bytes of an Ed25519 signature and of a public key.
SIGNATURE_SIZE = 64
PUBLIC_SIZE = 32


class SignatureError(SecureAggregationError):
    """A signed round's advert or confirmation that is missing, not the roster's, or forged.

    ``client`` is the client whose signature failed (on the coordinator:
    drop its rank); on a worker the error refuses the round for the
    worker's clients (the coordinator relayed what the client never signed).
    """


class EquivocationError(RefusedError):
    """A client refuses to reveal unmasking shares: the coordinator told survivors different
    sets, or too few confirmed the set this client was told."""


def _id8(value: int) -> bytes:
    return int(value).to_bytes(8, "big", signed=True)


def advert_message(round_seed: bytes, rnd: int, client: int, advert: bytes) -> bytes:
    """The bytes a client's advert signature covers (module docstring)."""
    return (ADVERT_LABEL + bytes(round_seed) + struct.pack(">Q", rnd) + _id8(client)
            + struct.pack(">I", len(advert)) + bytes(advert))


def confirm_message(round_seed: bytes, rnd: int, client: int, survivors: Sequence[int],
                    dropped: Sequence[int]) -> bytes:
    """The bytes a client's survivor confirmation covers (module docstring)."""
    return confirm_messages(round_seed, rnd, [client], survivors, dropped)[client]


def confirm_messages(round_seed: bytes, rnd: int, clients: Iterable[int],
                     survivors: Sequence[int], dropped: Sequence[int]) -> dict[int, bytes]:
    """:func:`confirm_message` of each of ``clients`` over the same sets (encoded once)."""
    head = CONFIRM_LABEL + bytes(round_seed) + struct.pack(">Q", rnd)
    tail = []
    for ids in (sorted(survivors), sorted(dropped)):
        tail.append(struct.pack(">I", len(ids)))
        tail.append(struct.pack(f">{len(ids)}q", *ids))
    sets = b"".join(tail)
    return {c: head + _id8(c) + sets for c in clients}


def sign(key: NodeKey, message: bytes) -> bytes:
    """``key``'s Ed25519 signature of ``message`` (64 bytes)."""
    return bytes(key.private.sign(message))


def verify(public: bytes, signature: bytes, message: bytes) -> bool:
    """Whether ``signature`` is ``public``'s Ed25519 signature of ``message``."""
    if len(public) != PUBLIC_SIZE or len(signature) != SIGNATURE_SIZE:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(bytes(public)).verify(bytes(signature), message)
    except (InvalidSignature, ValueError):
        return False
    return True


@attrs.frozen
class Roster:
    """The node keys whose signatures a signed round accepts (``where``: the file, for errors).

    Build one from an ``authorized_nodes`` file (:meth:`from_authorized`): its
    unrevoked keys; a key a line revokes never counts.
    """

    keys: frozenset[bytes]
    where: str = "the roster"

    @classmethod
    def from_authorized(cls, nodes: AuthorizedNodes) -> Roster:
        revoked = {k.public for k in nodes.keys if k.revoked}
        return cls(frozenset(k.public for k in nodes.keys if k.public not in revoked),
                   nodes.path)

    def problem(self, public: bytes) -> str | None:
        """Why a signature by ``public`` does not count, or None."""
        if bytes(public) in self.keys:
            return None
        return (f"its signer {fingerprint(bytes(public))} is not an admitted key of "
                f"{self.where}")


def check_adverts(roster: Roster, round_seed: bytes, rnd: int, adverts: Mapping[int, bytes],
                  signers: Mapping[int, bytes], signatures: Mapping[int, bytes],
                  blame: bool = False) -> None:
    """Each advert signed by a roster key over :func:`advert_message`, or :class:`SignatureError`.

    ``blame``: name the client whose advert failed as the one at fault (the
    coordinator checking what a worker sent); else the coordinator is (a
    worker checking what the coordinator relayed).
    """
    for client in sorted(adverts):
        public, signature = signers.get(client), signatures.get(client)
        why: str | None
        if public is None or signature is None or not any(public):
            why = "is unsigned"
        else:
            problem = roster.problem(public)
            why = f"is refused: {problem}" if problem else (
                None if verify(public, signature, advert_message(round_seed, rnd, client,
                                                                 adverts[client]))
                else "has a signature that does not verify over it")
        if why is not None:
            raise SignatureError(
                f"round {rnd}: client {client}'s advert {why}: a signed round needs every "
                f"advert signed by the node key (meshkit node --key) of an admitted node; "
                f"the coordinator may have put keys of its own in its place, so no secret "
                f"is shared this round", client if blame else None)


def check_confirmations(roster: Roster, round_seed: bytes, rnd: int, clients: Sequence[int],
                        survivors: Sequence[int], dropped: Sequence[int],
                        confirmed: Mapping[int, tuple[tuple[int, ...], tuple[int, ...]]],
                        confirmations: Iterable[tuple[int, bytes, bytes]],
                        advert_signers: Mapping[int, bytes], threshold: int) -> None:
    """Whether ``clients`` (one worker's) may reveal their unmasking shares, or
    :class:`EquivocationError`.

    ``survivors`` and ``dropped`` are the unmask request's sets,
    ``confirmed[c]`` the sets client c signed at ``secagg_confirm`` (absent:
    it confirmed none), ``confirmations`` the ``(client, signer, signature)``
    the coordinator collected, ``advert_signers[c]`` the key that signed c's
    advert. Counts the distinct survivors whose confirmation verifies over
    the sets under their advert's key (each verified once, for all
    ``clients``); fewer than ``threshold``, or than a strict majority of the
    clients the sets name, refuses (as does any confirmation that does not
    verify: the coordinator equivocated, or forged it).
    """
    told = (tuple(sorted(survivors)), tuple(sorted(dropped)))
    who = f"client {clients[0]}" if len(clients) == 1 else f"clients {list(clients)}"
    for client in clients:
        mine = confirmed.get(client)
        if mine != told:
            raise EquivocationError(
                f"round {rnd}: client {client} is asked to unmask for survivors "
                f"{list(told[0])}, dropped {list(told[1])}, but confirmed "
                + ("no survivor set" if mine is None else
                   f"survivors {list(mine[0])}, dropped {list(mine[1])}")
                + ": the coordinator changed the set after the consistency check; it "
                  "reveals no share")
    confirmations = list(confirmations)
    messages = confirm_messages(round_seed, rnd, [c for c, _, _ in confirmations], *told)
    good: set[int] = set()
    for other, public, signature in confirmations:
        if other not in told[0]:
            raise EquivocationError(
                f"round {rnd}: a confirmation from client {other}, not a survivor of the set "
                f"{who} was told; no share is revealed")
        expected = advert_signers.get(other)
        if expected is None or bytes(public) != expected or roster.problem(public) \
                or not verify(public, signature, messages[other]):
            raise EquivocationError(
                f"round {rnd}: client {other}'s confirmation does not verify over the survivor "
                f"set {who} was told (survivors {list(told[0])}, dropped {list(told[1])}) "
                f"under the key that signed its advert: the coordinator told survivors "
                f"different sets, or forged a confirmation; no share is revealed")
        good.add(other)
    named = len(told[0]) + len(told[1])
    needed = max(threshold, named // 2 + 1)
    if len(good) < needed:
        raise EquivocationError(
            f"round {rnd}: {len(good)} survivors confirmed the set {who} was told, "
            f"and it needs {needed} (the threshold {threshold}, and more than half of the "
            f"{named} clients the set names): no share is revealed. Two groups of survivors "
            f"told different sets could otherwise each unmask half of one client's secrets")
