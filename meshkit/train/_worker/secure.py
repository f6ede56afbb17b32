"""A worker's side of a secure round: one scheme client (:class:`meshkit.secure_aggregation.SchemeClient`) per client it plays.

Rule: every ``secagg_*`` request a worker answers is decided here, and the
update a client masks never leaves this module unmasked. The worker is the
trust boundary: it plays every simulated client it is given, so it sees
their updates in clear (docs/secure-aggregation.md, "Composition"); the
coordinator sees only public keys, sealed shares, the modular sum of the
worker's masked inputs, and the shares it needs to unmask the round's sum.

The ops, in the order a round sends them (docs/protocol.md §7.2):

``secagg_keys``
    the round's scheme (``scheme``: a ``[secure_aggregation] name``, absent
    for the default, built with its default options through the plugins) and
    a fresh scheme client per client (SecAgg+: fresh key pairs, fresh
    self-mask seed): their adverts. A scheme with the trait ``party`` builds
    the worker's clients together (:meth:`~meshkit.secure_aggregation.PartyScheme.party`).
``secagg_share``
    every member's advert; each client's roster is its neighbours' adverts in
    the round's graph: the sealed shares, one row per neighbour.
``secagg_open``
    the shares delivered to each client, opened; the reply lists the rows
    that did not open (tampered or garbage from their sealer): accusations,
    which cost nobody on this worker's word.
``secagg_reveal``
    only after an accusation against one of this worker's clients: the
    ephemeral private key it sealed that one share with, so the coordinator
    can open it itself and see whether the sealer or the accuser lied.
``secagg_mask``
    each client's fit (the ordinary ``fit`` path of :class:`Trainer`, so
    ``--attack`` and ``[privacy] clip = "client"`` apply as they do in plain
    rounds) from the round's model, the update (fitted minus the model, the
    float arrays in sorted key order: :func:`update_vector`) quantised and
    masked with every neighbour that shared except the ``excluded`` (the
    parties found at fault); the reply is the sum mod ``2**modulus_bits`` of
    this worker's masked inputs (a fold of its own, as a relay does), packed
    at ``modulus_bits`` bits an element
    (:func:`meshkit.secure_aggregation.to_wire`). With ``compress`` (the
    run's ``[compression]``, whose keys request named ``input_bits``) the
    update is quantised by that compressor onto the round's shared grid
    (:func:`meshkit.compression.field_codes`), not by the scheme. With
    ``ddp_*`` (``[privacy] placement = "distributed"``) the clipped update is
    put on the round's Skellam grid and the client's share of the noise is
    added here, before masking (:class:`meshkit.privacy.SkellamPlan`). A
    party is told the request's clients first (``summing``): all of them are
    in the sum, or the reply is an error and none is.
``secagg_confirm``
    a signed round only: each survivor's signature of the survivor and
    dropped sets it was told (:func:`meshkit.secure_aggregation.confirm_message`).
``secagg_unmask``
    each survivor's shares of the survivors' self-mask seeds and the dropped
    clients' mask keys.

**Signed rounds** (docs/protocol.md §7.2.2, :class:`Signing`): a worker with
a node key (``meshkit node --key``) signs its clients' adverts and
confirmations; a worker with a roster (``meshkit node --roster``) checks
every member's advert before its clients share a secret
(:func:`~meshkit.secure_aggregation.check_adverts`) and, before revealing a
share, that threshold survivors confirmed the very sets it was told
(:func:`~meshkit.secure_aggregation.check_confirmations`); either check
failing refuses the step for all its clients (an ``error`` reply naming
the client and the check), and the round goes on without them.

Fault injection, for tests only: ``MESHKIT_FAULT_EXIT_AFTER_MASKING =
"ROUND:CLIENT,..."`` in a worker's environment makes the worker process exit
(status 70) right after it sent the masked input of CLIENT in ROUND -- a
client that drops after masking, as the protocol must survive. Nothing else
reads it.

Common random numbers, for the paired DP benchmark only: a seeded
(``ddp_noise = "seeded"``) client's Skellam share comes from
:func:`meshkit.privacy.common_skellam` when ``MESHKIT_BENCH_COMMON_NOISE``
is set in the worker's environment (docs/privacy.md, "Common random
numbers"); OS noise never reads it.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
from typing import Any, Callable, Mapping, cast

import attrs
import numpy as np

from meshkit import plugins
from meshkit.compression import field_codes, key_seed
from meshkit.config import DEFAULT_SECURE_AGGREGATION
from meshkit.errors import MeshError, RefusedError
from meshkit.privacy import SkellamPlan, common_noise_key, common_skellam, field_levels
from meshkit.secure_aggregation import (PartyScheme, Roster, RoundParams, Scheme, SchemeClient,
                                        SchemeParty, SecureAggregationTraits, add_mod,
                                        advert_message, check_adverts, check_confirmations,
                                        confirm_messages, scheme_traits, sign, to_wire,
                                        vector_dtype)
from meshkit.wire import NodeKey
from meshkit.state import update_keys

__all__ = ["SecureClients", "Signing", "update_vector", "vector_keys", "FAULT_ENV"]

log = logging.getLogger(__name__)

#: The test-only fault injection (module docstring).
FAULT_ENV = "MESHKIT_FAULT_EXIT_AFTER_MASKING"
#: The stream of a client's seeded Skellam noise (``ddp_noise = "seeded"``), off its fit seed.
DDP_STREAM = 0xD1D9
#: A worker that exits by :data:`FAULT_ENV` exits with this status.
FAULT_STATUS = 70


def vector_keys(state: Mapping[str, Any]) -> list[str]:
    """The keys a secure round sums (:func:`meshkit.state.update_keys`): the floating-point
    arrays (bfloat16 included), in sorted order.

    Integer arrays, integer buffers carried as float64 counts (BatchNorm's
    ``num_batches_tracked``, listed in the state's ``INT_BUFFERS`` leaf) and JSON
    entries are not summed; the round's new model keeps the global model's
    values for them (as a private round does).
    """
    return update_keys(state)


def update_vector(fitted: Mapping[str, Any], start: Mapping[str, Any],
                  keys: list[str]) -> np.ndarray:
    """``fitted - start`` over ``keys``, flattened in that order, in float64."""
    for key in keys:
        if key not in fitted or np.shape(fitted[key]) != start[key].shape:
            raise MeshError(f"the fit's model has no {key!r} of the round model's shape "
                            f"{list(start[key].shape)}")
    out = np.empty(sum(start[key].size for key in keys), np.float64)
    offset = 0
    for key in keys:
        # One pass into place: each side widened to float64 as the subtraction reads it
        # (exact), the difference rounded once in float64, as converting both first would.
        size = start[key].size
        np.subtract(np.asarray(fitted[key]).reshape(-1), np.asarray(start[key]).reshape(-1),
                    out=out[offset:offset + size], dtype=np.float64)
        offset += size
    return out


def _rows(rows: list[bytes], width: int) -> np.ndarray:
    """Byte rows of one ``width`` as the wire's 2-d uint8 array (n x width, n may be 0)."""
    for row in rows:
        if len(row) != width:
            raise MeshError(f"the scheme gave a row of {len(row)} bytes; it declares {width}")
    return (np.frombuffer(b"".join(rows), np.uint8).reshape(len(rows), width) if rows
            else np.zeros((0, width), np.uint8))


def _expect(rows: np.ndarray, width: int, what: str) -> None:
    """The coordinator's rows are the scheme's width (its traits), or the request is refused."""
    if rows.shape[1] != width:
        raise MeshError(f"{what} rows are {rows.shape[1]} bytes wide; this round's scheme "
                        f"declares {width}")


def _faults(text: str) -> set[tuple[int, int]]:
    """``"ROUND:CLIENT,..."`` as a set of (round, client)."""
    found = set()
    for item in filter(None, (part.strip() for part in text.split(","))):
        rnd, _, client = item.partition(":")
        found.add((int(rnd), int(client)))
    return found


@attrs.frozen
class Signing:
    """A worker's part in signed rounds: its node ``key`` (signs; None: signs nothing) and the
    ``roster`` of keys it accepts signatures from (None: checks nothing); and the least
    distributed-DP noise its clients add their updates under, ``min_noise_multiplier``
    (``meshkit node --min-noise-multiplier``; 0: checks nothing): a masking request whose
    ``ddp_*`` would give the sum of the round's clients less is refused before any fit."""

    key: NodeKey | None = None
    roster: Roster | None = None
    min_noise_multiplier: float = 0.0


def _row(rows: Any, i: int) -> bytes:
    return bytes(np.asarray(rows[i], np.uint8))


class SecureClients:
    """The clients a worker plays in the current secure round (module docstring).

    ``fit(request) -> (fitted state, start state)`` runs one client's fit the
    way the worker's ``fit`` op does.
    """

    def __init__(self, signing: Signing | None = None) -> None:
        #: Signed rounds (:class:`Signing`): this worker's key and roster.
        self.signing = signing or Signing()
        #: The key that signed each member's advert this round (a roster checked it).
        self.advert_signers: dict[int, bytes] = {}
        #: The (survivors, dropped) each of this worker's clients confirmed this round.
        self.confirmed: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self.scheme: Scheme | None = None
        self.traits: SecureAggregationTraits | None = None
        self.params: RoundParams | None = None
        self.round = 0
        self.seed = b""
        self.length = 0
        self.rounds: dict[int, SchemeClient] = {}
        #: The round's members (every client that advertised), sorted.
        self.members: list[int] = []
        #: The round's clients built together (a scheme with the trait ``party``), else None.
        self.party: SchemeParty | None = None
        #: The schemes built so far, by name (a worker plays one run's rounds).
        self.schemes: dict[str, Scheme] = {}
        #: The round's codes' bits when a compressor quantises (0: the scheme does).
        self.input_bits = 0
        #: Compressors named by masking requests, built once per name and options.
        self.compressors: dict[str, Any] = {}
        #: Set by a masked reply the fault injection names; read after the reply is sent.
        self.exit_pending = False

    def handle(self, op: str, request: Mapping[str, Any],
               fit: Callable[[Mapping[str, Any]], tuple[Mapping[str, Any], Mapping[str, Any]]]
               ) -> dict[str, Any]:
        """The reply to one ``secagg_*`` request (checked against its schema already)."""
        if op == "secagg_keys":
            return self._keys(request)
        if op == "secagg_share":
            return self._share(request)
        if op == "secagg_open":
            return self._open(request)
        if op == "secagg_reveal":
            return self._reveal(request)
        if op == "secagg_mask":
            return self._mask(request, fit)
        if op == "secagg_confirm":
            return self._confirm(request)
        if op == "secagg_unmask":
            return self._unmask(request)
        raise MeshError(f"unknown secure-aggregation request {op!r}")

    def _scheme(self, name: str) -> Scheme:
        if name not in self.schemes:
            self.schemes[name] = plugins.create("secure_aggregation", name)
        return self.schemes[name]

    def _keys(self, request: Mapping[str, Any]) -> dict[str, Any]:
        scheme = self._scheme(request.get("scheme") or DEFAULT_SECURE_AGGREGATION)
        self.scheme, self.traits = scheme, scheme_traits(scheme)
        self.input_bits = int(request.get("input_bits") or 0)
        narrowed = {"input_bits": self.input_bits} if self.input_bits else {}
        self.params = scheme.params(clients=int(request["cohort"]),
                                    degree=int(request["degree"]),
                                    threshold=int(request["threshold"]),
                                    clip_range=float(request["clip_range"]),
                                    modulus_bits=int(request["modulus_bits"]), **narrowed)
        self.round = int(request["round"])
        self.seed = bytes(request["round_seed"][0])
        self.length = int(request["length"])
        self.exit_pending = False
        ids = [int(c) for c in request["clients"]]
        self.party = None
        if self.traits.party:
            self.party = cast(PartyScheme, scheme).party(self.params, sorted(ids), self.seed,
                                                         self.length)
            built = dict(self.party.clients)
            if sorted(built) != sorted(ids):
                raise MeshError(f"the scheme's party plays clients {sorted(built)}, not the "
                                f"{sorted(ids)} it was asked for")
            self.rounds = {c: built[c] for c in ids}
        else:
            self.rounds = {c: scheme.client(self.params, c, self.seed, self.length)
                           for c in ids}
        adverts = [self.rounds[c].advertise() for c in sorted(self.rounds)]
        self.advert_signers, self.confirmed = {}, {}
        reply = {"clients": sorted(self.rounds),
                 "adverts": _rows(adverts, self.traits.advert_size)}
        key = self.signing.key
        if key is not None:  # a signed round's advert (docs/protocol.md §7.2.2)
            reply["signer"] = _rows([key.public], 32)
            reply["signatures"] = _rows(
                [sign(key, advert_message(self.seed, self.round, c, a))
                 for c, a in zip(sorted(self.rounds), adverts)], 64)
        return reply

    def _require(self, clients: Any) -> None:
        missing = sorted(set(map(int, clients)) - set(self.rounds))
        if self.params is None or missing:
            raise MeshError(f"clients {missing or list(clients)} have no secure round here "
                            f"(a secagg_keys request starts one)")

    def _share(self, request: Mapping[str, Any]) -> dict[str, Any]:
        self._require(self.rounds)
        assert self.traits is not None  # _require checked it
        _expect(request["adverts"], self.traits.advert_size, "advert")
        members = [int(m) for m in request["members"]]
        self.members = sorted(members)
        adverts = {m: bytes(row) for m, row in zip(members, request["adverts"])}
        if self.signing.roster is not None:  # before any secret is sealed to these keys
            keys, sigs = request.get("signers"), request.get("signatures")
            signers = {} if keys is None else {m: _row(keys, i) for i, m in enumerate(members)}
            signatures = ({} if sigs is None
                          else {m: _row(sigs, i) for i, m in enumerate(members)})
            check_adverts(self.signing.roster, self.seed, self.round, adverts, signers,
                          signatures)
            mine = self.signing.key.public if self.signing.key is not None else None
            for client in self.rounds:
                if client in signers and signers[client] != mine:
                    raise MeshError(f"round {self.round}: client {client}'s advert is relayed "
                                    f"signed by another node's key; this worker signed it")
            self.advert_signers = signers
        senders, recipients, sealed = [], [], []
        for client in sorted(self.rounds):
            if client not in adverts:
                raise MeshError(f"client {client} is not among the round's members")
            for recipient, row in self.rounds[client].share(members, adverts):
                senders.append(client)
                recipients.append(int(recipient))
                sealed.append(bytes(row))
        return {"senders": senders, "recipients": recipients,
                "sealed": _rows(sealed, self.traits.sealed_size)}

    def _open(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Each client opens the shares delivered to it; the rows that did not open come back.

        An accusation costs nobody here: the coordinator settles it from the
        sealer's revealed key (``secagg_reveal``), never on this worker's word.
        """
        clients = [int(c) for c in request["clients"]]
        self._require(clients)
        assert self.traits is not None  # _require checked it
        _expect(request["sealed"], self.traits.sealed_size, "sealed")
        inbox: dict[int, list[tuple[int, bytes]]] = {c: [] for c in clients}
        for sender, recipient, row in zip(request["senders"], request["recipients"],
                                          request["sealed"]):
            if int(recipient) not in inbox:
                raise MeshError(f"a share delivered for client {recipient}, not one of "
                                f"{clients}")
            inbox[int(recipient)].append((int(sender), bytes(row)))
        senders, recipients = [], []
        for client in clients:
            for sender in self.rounds[client].open(sorted(inbox[client], key=lambda r: r[0])):
                log.warning("round %d: client %d's shares from client %d do not open",
                            self.round, client, sender)
                senders.append(sender)
                recipients.append(client)
        return {"senders": senders, "recipients": recipients}

    def _reveal(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """The ephemeral key of each accused share (each opens that one share pair only)."""
        senders = [int(c) for c in request["senders"]]
        self._require(senders)
        assert self.traits is not None  # _require checked it
        keys = [self.rounds[s].reveal(int(r)) for s, r in zip(senders, request["recipients"])]
        return {"keys": _rows(keys, self.traits.reveal_size)}

    def _mask(self, request: Mapping[str, Any],
              fit: Callable[[Mapping[str, Any]], tuple[Mapping[str, Any], Mapping[str, Any]]]
              ) -> dict[str, Any]:
        clients = [int(c) for c in request["clients"]]
        self._require(clients)
        assert self.params is not None and self.scheme is not None  # _require checked it
        bits = self.params.modulus_bits
        excluded = [int(c) for c in request["excluded"]]
        total: np.ndarray | None = None
        extra = {k: request[k] for k in ("time_budget", "clip_norm")
                 if request.get(k) is not None}
        compressor = self._compressor(request.get("compress"))
        noise = self._noise(request)
        if self.party is not None:
            self.party.summing(sorted(clients))  # exactly the clients this reply adds
        for client, seed in zip(clients, request["seeds"]):
            fitted, start = fit({"op": "fit", "shard": client, "shards": int(request["shards"]),
                                 "seed": int(seed), **extra})
            update = update_vector(fitted, start, vector_keys(start))
            if update.size != self.length:
                raise MeshError(f"the round's updates have {self.length} elements; this "
                                f"worker's model gives {update.size}")
            if noise is not None:
                rng = (np.random.default_rng(np.random.SeedSequence([int(seed), DDP_STREAM]))
                       if request["ddp_noise"] == "seeded"
                       else np.random.default_rng(secrets.randbits(128)))
                quantised, clipped = noise.encode(update, rng, vector_dtype(bits),
                                                  self._common_share(request, client, noise))
                if clipped:
                    log.warning("round %d: client %d's noised update left its share of the "
                                "field in %d coordinates (clipped there)", self.round, client,
                                clipped)
            elif compressor is None:
                quantised = self.scheme.quantize(update, self.params)
            else:
                quantised = field_codes(compressor, update, seed=key_seed(int(seed), 0),
                                        clip_range=self.params.clip_range,
                                        dtype=vector_dtype(bits))
            del update, fitted  # the clear update goes no further than this line
            masked = self.rounds[client].mask(quantised, excluded)
            if masked.dtype != vector_dtype(bits) or masked.ndim != 1 or (
                    total is not None and masked.shape != total.shape):
                raise MeshError(f"the scheme masked client {client}'s update as "
                                f"{masked.dtype}{list(masked.shape)}; the round's field needs "
                                f"one {vector_dtype(bits)} vector of one length")
            total = masked.copy() if total is None else add_mod(total, masked, bits, out=total)
        assert total is not None  # the schema asks for at least one client
        faults = _faults(os.environ.get(FAULT_ENV, ""))
        self.exit_pending = any((self.round, c) in faults for c in clients)
        return {"clients": clients, **to_wire(total, bits)}

    def _common_share(self, request: Mapping[str, Any], client: int,
                      plan: SkellamPlan) -> np.ndarray | None:
        """A seeded round's Skellam share from the paired benchmark's common numbers
        (:func:`~meshkit.privacy.common_skellam`, keyed by ``MESHKIT_BENCH_COMMON_NOISE``,
        the client's slot the place of its id among the round's members); None, and the
        share drawn as always, for OS noise or when the benchmark did not set it."""
        key = common_noise_key(request["ddp_noise"])
        if key is None:
            return None
        slot = self.members.index(client)
        return common_skellam(key, self.round, slot, plan.variance, plan.length)

    def _noise(self, request: Mapping[str, Any]) -> SkellamPlan | None:
        """A distributed-DP round's grid and Skellam share (``ddp_*``), checked against the
        round's field: each client's noised coordinate must stay within its share."""
        if request.get("ddp_scale") is None:
            return None
        assert self.params is not None  # _require checked it
        if "clip_norm" not in request or request.get("clip_norm") is None:
            raise MeshError("a distributed-DP masking request must name the clip_norm each "
                            "update is clipped to first")
        if self.input_bits:
            raise MeshError("a distributed-DP round's field cannot also hold a compressor's "
                            "codes")
        levels = field_levels(self.params.modulus_bits, self.params.clients)
        half = int(request["ddp_half"])
        if 2 * half > levels:
            raise MeshError(f"ddp_half = {half}: a client's share of this round's field holds "
                            f"values up to {levels}")
        scale, bound = float(request["ddp_scale"]), float(request["ddp_bound"])
        if bound < float(request["clip_norm"]) * scale:
            raise MeshError(f"ddp_bound = {bound:g} is below the clipped update's norm on the "
                            f"grid ({float(request['clip_norm']) * scale:g})")
        self._check_noise_floor(request, scale)
        return SkellamPlan(scale=scale, variance=float(request["ddp_variance"]), bound=bound,
                           half=half, length=self.length, cohort=self.params.clients)

    def _check_noise_floor(self, request: Mapping[str, Any], scale: float) -> None:
        """Refuse a ``ddp_variance`` that, summed over the round's clients, is less noise
        than this node accepts: z = √(variance·n) / (clip_norm·scale), the noise multiplier
        of the sum when all n of the round's clients contribute."""
        floor = self.signing.min_noise_multiplier
        if floor <= 0:
            return
        assert self.params is not None  # _noise's caller checked it
        clients, clip = self.params.clients, float(request["clip_norm"])
        variance = float(request["ddp_variance"])
        planned = math.sqrt(variance * clients) / (clip * scale)
        if planned < floor * (1 - 1e-9):
            need = (floor * clip * scale) ** 2 / clients
            raise RefusedError(
                f"round {self.round}: the coordinator asks for Skellam variance {variance:.6g} "
                f"per client and coordinate; over the round's {clients} clients the sum would "
                f"carry noise multiplier {planned:.4g}, below the {floor:g} this node accepts "
                f"(meshkit node --min-noise-multiplier). It would need ddp_variance >= "
                f"{need:.6g} at clip_norm {clip:g} and ddp_scale {scale:g}, i.e. [privacy] "
                f"noise_multiplier >= {floor:g}")

    def _compressor(self, chosen: Mapping[str, Any] | None) -> Any:
        """The masking request's compressor (None: the scheme quantises), checked against
        the keys request: codes of ``input_bits`` bits, or none."""
        if chosen is None:
            if self.input_bits:
                raise MeshError(f"the round's field was narrowed for {self.input_bits}-bit "
                                f"codes, and the masking request names no compressor")
            return None
        cache = f"{chosen['name']}:{sorted(chosen['options'].items())!r}"
        if cache not in self.compressors:
            self.compressors[cache] = plugins.default().create(
                "compression", chosen["name"], chosen["options"])
        compressor = self.compressors[cache]
        if int(compressor.field_bits) != self.input_bits:
            raise MeshError(f"the masking request's compressor {chosen['name']!r} makes "
                            f"{compressor.field_bits}-bit codes; the round's field was set up "
                            f"for {self.input_bits}")
        return compressor

    def _confirm(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Each client signs the survivor and dropped sets it is told (remembered, so an
        unmask request with other sets is refused)."""
        clients = [int(c) for c in request["clients"]]
        self._require(clients)
        key = self.signing.key
        if key is None:
            raise MeshError("secagg_confirm: a signed round needs this worker's node key "
                            "(meshkit node --key FILE, made by `meshkit keygen`)")
        survivors = tuple(sorted(int(c) for c in request["survivors"]))
        dropped = tuple(sorted(int(c) for c in request["dropped"]))
        signatures = []
        for client in clients:
            if client in self.confirmed and self.confirmed[client] != (survivors, dropped):
                raise MeshError(f"round {self.round}: client {client} already confirmed "
                                f"another survivor set; it confirms one only")
            self.confirmed[client] = (survivors, dropped)
        messages = confirm_messages(self.seed, self.round, clients, survivors, dropped)
        for client in clients:
            signatures.append(sign(key, messages[client]))
        return {"clients": clients, "signer": _rows([key.public], 32),
                "signatures": _rows(signatures, 64)}

    def _unmask(self, request: Mapping[str, Any]) -> dict[str, Any]:
        clients = [int(c) for c in request["clients"]]
        self._require(clients)
        survivors = tuple(int(c) for c in request["survivors"])
        dropped = tuple(int(c) for c in request["dropped"])
        assert self.traits is not None and self.params is not None  # _require checked it
        if self.signing.roster is not None:  # the consistency check, before any share leaves
            confirmed = [int(c) for c in request.get("confirmed") or ()]
            keys, sigs = request.get("confirm_signers"), request.get("confirm_signatures")
            confirmations = [(c, _row(keys, i), _row(sigs, i)) for i, c in enumerate(confirmed)]
            check_confirmations(self.signing.roster, self.seed, self.round, clients,
                                survivors, dropped, self.confirmed, confirmations,
                                self.advert_signers, self.params.threshold)
        holders, owners, kinds, shares = [], [], [], []
        for client in clients:
            for owner, kind, share in self.rounds[client].unmask(survivors, dropped):
                holders.append(client)
                owners.append(int(owner))
                kinds.append(int(kind))
                shares.append(bytes(share))
        return {"holders": holders, "owners": owners, "kinds": kinds,
                "shares": _rows(shares, self.traits.share_size)}

    def after_reply(self) -> None:
        """Called when the request after the masked reply arrives (that reply is taken in by
        then): the test-only fault injection's exit."""
        if self.exit_pending:
            log.warning("%s: exiting after the masked input of round %d (fault injection)",
                        FAULT_ENV, self.round)
            logging.shutdown()
            os._exit(FAULT_STATUS)
