"""The coordinator's side of a secure round: it learns the sum of the clients' updates, never one.

Rule: every byte a secure round takes in from a worker goes through this
module into one scheme server (:class:`meshkit.secure_aggregation.SchemeServer`,
built by the run's ``[secure_aggregation]`` scheme), and what comes out is
the exact integer sum of the surviving clients' quantised updates,
dequantised. No individual update, masked or not, is kept past
``receive_masked`` (which folds it into a running modular sum). The module
knows no scheme: it checks each row's width against the scheme's
:class:`~meshkit.secure_aggregation.SecureAggregationTraits` and decides by
them (a scheme that does not tolerate dropouts has its round refused when a
client is lost, naming the trait).

How a round goes (:func:`secure_sum`; the worker's side is
:mod:`meshkit.train._worker.secure`):

1. The cohort is planned round-robin over the live workers, in client order
   (the first worker the first client, ...); a worker plays every client it
   is given, so the trust boundary is the worker, not the simulated client.
   The round's model goes once to each (``set_state``).
2. ``secagg_keys``: each worker starts a fresh scheme client per client
   (SecAgg+: fresh X25519 pairs, fresh self-mask seed) and sends the adverts.
3. ``secagg_share``: every advert goes to every worker; each client seals
   Shamir shares of its two secrets to its neighbours in the round's graph.
4. ``secagg_mask``: the shares are routed to their recipients; each worker
   fits its clients, quantises and masks their updates, and answers with the
   sum mod ``2**modulus_bits`` of its clients' masked inputs.
5. ``secagg_confirm``, a signed round only (every advert came signed by
   its worker's node key: docs/protocol.md §7.2.2): each survivor signs the
   survivor and dropped sets; the unmask request carries every
   confirmation, and a worker with a roster reveals nothing unless
   threshold survivors confirmed the sets it was told.
6. ``secagg_unmask``: the survivors (whose masked input arrived) send the
   shares that remove the self-masks of the survivors and the pairwise masks
   of those who dropped after sharing; the server's ``finish`` rebuilds the
   integer sum, or refuses (:class:`~meshkit.RefusedError`) when fewer than
   ``threshold`` survive: nothing is revealed in part.

A worker lost at any step takes its clients out of the round: before
masking they are dropouts whose pairwise masks are cancelled, after masking
their inputs stay in the sum (their self-masks rebuilt from the survivors'
shares). They are never served again by another worker in the same round:
a re-served client would need fresh keys, and its shares are already with
its neighbours. A worker whose reply does not fit its schema, or whose
keys, shares or vector the scheme refuses
(:class:`~meshkit.secure_aggregation.SecureAggregationError`, a
:class:`~meshkit.ProtocolError`),
is declared dead with a ``protocol error`` reason, like any breach: its
clients drop out, the round goes on.

The round's parameters (degree, threshold, clip range, field) are the
scheme's :meth:`~meshkit.secure_aggregation.Scheme.plan` for the cohort;
the kernel refuses a cohort below 3 clients or outside the scheme's
``min_clients`` / ``max_clients`` first.

Under ``[compression]`` (a compressor with ``integer_field``, a scheme with
``integer_inputs``: :func:`meshkit.compression.check_compression`) the
field is narrowed to ``field_bits + ceil(log2 n)`` bits: each client's
update is put on the round's shared grid by the compressor
(:func:`meshkit.compression.field_codes`, on the worker) instead of the
scheme's quantiser, and the unmasked integer sum is decoded once, by the
compressor (:func:`meshkit.compression.decode_field_sum`). Every masked
vector travels ``modulus_bits`` bits an element
(:func:`meshkit.secure_aggregation.to_wire`).
"""

from __future__ import annotations

import logging
import math
import secrets
from typing import Any, Callable, Mapping, Sequence, cast

import attrs
import numpy as np

from meshkit.compression import CompressionPlan, decode_field_sum
from meshkit.config import DEFAULT_SECURE_AGGREGATION
from meshkit.errors import ConfigError, ProtocolError, RefusedError, WorkerError
from meshkit.privacy import SkellamPlan
from meshkit.secure_aggregation import (InterleavedScheme, RoundParams, SchemeChoice,
                                        SchemeServer, Roster, SecureAggregationError, SignatureError,
                                        SecureAggregationTraits, check_adverts,
                                        confirm_messages, field_width, from_wire, verify)
from meshkit.train._pool import call as pool_call
from meshkit.train._pool import protocol_reason
from meshkit.train._relay.secure import masked_sum_request, parse_masked_sum_answer
from meshkit.train._worker.secure import vector_keys
from meshkit.train._strategy import StrategyContext
from meshkit.wire import AuthorizedNodes

__all__ = ["SecureSum", "secure_sum", "round_params", "plan_cohort", "secure_plan"]

log = logging.getLogger(__name__)

#: The size of a round's public seed (the graph, the keys' derivations).
SEED_SIZE = 32


@attrs.frozen(eq=False)
class SecureSum:
    """What a secure round revealed.

    ``sum`` maps each summed key (:func:`~meshkit.train._worker.secure.vector_keys`)
    to the float64 sum of the ``contributors``' clipped updates;
    ``served`` maps each contributor to the rank that played it;
    ``not_served`` each other sampled client to why it is not in the sum.
    """

    sum: dict[str, np.ndarray]
    contributors: tuple[int, ...]
    served: dict[int, int]
    not_served: dict[int, str]
    params: RoundParams
    #: The exact integer sum of the contributors' quantised updates (mod 2**modulus_bits).
    total: np.ndarray
    #: Shared their secrets, sent no masked input: their pairwise masks were cancelled.
    dropped: tuple[int, ...] = ()
    #: A distributed-DP round's grid and noise (its ``sum`` carries the contributors' noise).
    noise: SkellamPlan | None = None

    def mean(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """``state`` moved by the contributors' mean update (each counts once), dtypes kept."""
        out = dict(state)
        count = len(self.contributors)
        for key, total in self.sum.items():
            ref = state[key]
            out[key] = (np.asarray(ref, np.float64) + total / count).astype(ref.dtype)
        return out


def round_params(choice: SchemeChoice, clients: int, where: str = "[secure_aggregation]",
                 per_worker: int = 1, input_bits: int = 0, interleave: int = 0) -> RoundParams:
    """The round's parameters for a cohort of ``clients``: the scheme's plan, after the
    kernel's refusals (fewer than 3 clients, or outside the scheme's declared cohort sizes).

    ``per_worker`` is the most clients one worker plays this round (what a
    scheme that tolerates dropouts must survive losing). ``input_bits`` > 0:
    the inputs are a compressor's codes below ``2**input_bits``, masked in the
    field of :func:`~meshkit.secure_aggregation.field_width` bits (the scheme
    must declare ``integer_inputs``). ``interleave`` > 0: the cohort was
    placed round-robin on that many workers in the scheme's order (the trait
    ``interleave``). A refusal from the scheme's plan is given ``where``'s
    file name.
    """
    traits = choice.traits
    if clients < 3:
        raise RefusedError(
            f"{where}: a secure round of {clients} client(s): with one the sum is its update, "
            f"with two each learns the other's from the sum and its own. Sample at least 3 "
            f"clients per round ([strategy] clients, fraction, min_clients)")
    if clients < traits.min_clients:
        raise RefusedError(
            f"{where} name = {choice.name!r}: a secure round of {clients} clients, and the "
            f"scheme serves at least {traits.min_clients} (its trait "
            f"SecureAggregationTraits.min_clients). Sample more clients per round "
            f"([strategy] clients, fraction, min_clients)")
    if clients > traits.max_clients:
        raise ConfigError(
            f"{where}: a secure round of {clients} clients; at most {traits.max_clients} can "
            f"take part in one of scheme {choice.name!r} (its trait "
            f"SecureAggregationTraits.max_clients). Lower [strategy] clients or fraction")
    if input_bits and not traits.integer_inputs:
        raise RefusedError(
            f"{where} name = {choice.name!r}: the round's inputs are a compressor's "
            f"{input_bits}-bit codes, and the scheme masks only updates it quantised itself "
            f"(it lacks the trait SecureAggregationTraits.integer_inputs). Drop "
            f"[compression] or select a scheme that has it (secagg+)")
    # Only what a scheme declared it takes is passed: a scheme without the traits keeps
    # the two-argument plan of the contract.
    extra: dict[str, int] = {}
    if input_bits:
        extra["input_bits"] = input_bits
    if interleave:
        extra["interleave"] = interleave
    try:
        params = choice.scheme.plan(clients, per_worker, **extra)
    except (ConfigError, RefusedError) as exc:
        prefix = where.removesuffix("[secure_aggregation]")
        raise type(exc)(f"{prefix}{exc}") from None
    field = field_width(input_bits, clients) if input_bits else traits.modulus_bits
    if params.modulus_bits != field or params.clients != clients:
        raise RefusedError(
            f"{where} name = {choice.name!r}: the scheme planned a round of {params.clients} "
            f"clients mod 2^{params.modulus_bits} for a cohort of {clients}, and the round's "
            f"field is 2^{field} ("
            + (f"{input_bits}-bit inputs summed over {clients} clients"
               if input_bits else "SecureAggregationTraits.modulus_bits")
            + "): the scheme contradicts itself; report it to its author")
    return params


def plan_cohort(cohort: Sequence[int], live: Sequence[int],
                pinned: Mapping[int, int] | None = None,
                order: Sequence[int] | None = None) -> dict[int, list[int]]:
    """Which rank plays which clients (each rank's sorted): ``pinned``, or round-robin over
    ``live`` in ``order`` (a scheme's, the trait ``interleave``), or in client order."""
    plan: dict[int, list[int]] = {}
    for i, client in enumerate(sorted(cohort) if order is None else order):
        rank = live[i % len(live)] if pinned is None else pinned[client]
        plan.setdefault(rank, []).append(client)
    return {rank: sorted(clients) for rank, clients in plan.items()}


def interleaved_order(choice: SchemeChoice, cohort: Sequence[int],
                      round_seed: bytes) -> list[int]:
    """The scheme's order of ``cohort`` for this round (the trait ``interleave``), checked."""
    order = [int(c) for c in cast(InterleavedScheme, choice.scheme).order(round_seed, cohort)]
    if sorted(order) != sorted(cohort):
        raise RefusedError(
            f"[secure_aggregation] name = {choice.name!r}: the scheme's order() of a cohort of "
            f"{len(cohort)} clients is not a permutation of it: the scheme contradicts itself; "
            f"report it to its author")
    return order


def secure_plan(choice: SchemeChoice, clients: int, workers: int, fraction: float = 1.0,
                min_clients: int = 1, path: str = "",
                compression: CompressionPlan | None = None) -> dict[str, Any]:
    """What ``meshkit check`` says of a secure run's rounds: the cohort, graph and survival.

    ``clients`` the run's clients, ``workers`` the live workers a round is
    planned over (``[mesh] workers``), ``fraction`` and ``min_clients`` the
    cohort's sampling (a fixed cohort of ``ceil(fraction * clients)``),
    ``compression`` the run's ``[compression]`` (its codes narrow the field).
    Raises :class:`~meshkit.ConfigError` naming ``[strategy] clients`` for a
    cohort above the scheme's ``max_clients``, and what :func:`round_params`
    raises.
    """
    traits = choice.traits
    cohort = min(clients, max(1, min_clients, math.ceil(round(fraction * clients, 9))))
    if cohort > traits.max_clients:
        raise ConfigError(
            f"{path}: [strategy] clients = {clients}: a secure round's cohort would be "
            f"{cohort} clients, and at most {traits.max_clients} can take part in one of "
            f"scheme {choice.name!r} (its trait SecureAggregationTraits.max_clients). Lower "
            f"[strategy] clients, or sample fewer with [strategy] fraction")
    plan = plan_cohort(range(cohort), list(range(1, max(1, workers) + 1)))
    loads = [len(cs) for cs in plan.values()]
    where = f"{path}: [secure_aggregation]" if path else "[secure_aggregation]"
    interleave = len(loads) if traits.interleave else 0
    params = round_params(choice, cohort, where=where, per_worker=max(loads),
                          input_bits=_input_bits(compression), interleave=interleave)
    facts: dict[str, Any] = {"cohort": cohort, "workers": len(loads),
                             # What a masked coordinate costs on the wire (to_wire).
                             "modulus_bits": params.modulus_bits,
                             "clip_range": params.clip_range,
                             "clients_per_worker": max(loads),
                             "tolerates_dropouts": traits.tolerates_dropouts,
                             "survives_losing_workers": 0, "survives_losing_clients": 0}
    if traits.tolerates_dropouts:
        facts.update(cast(InterleavedScheme, choice.scheme).describe(
            params, loads, interleave=interleave) if interleave
            else choice.scheme.describe(params, loads))
    return facts


def _input_bits(compression: CompressionPlan | None) -> int:
    """The bits of a compressed round's codes (0: the scheme quantises)."""
    return 0 if compression is None else int(compression.compressor.field_bits)


def _bad(ctx: StrategyContext, rank: int, error: ProtocolError, lost: dict[int, str]) -> None:
    """``rank`` sent what the round refuses: it is declared dead, its clients drop out."""
    reason = protocol_reason(error)
    ctx.pool.declare_dead(rank, reason)
    lost[rank] = ctx.pool.dead.get(rank, reason)


def _failed(ctx: StrategyContext, rank: int, error: str, lost: dict[int, str],
            accept_failures: bool) -> None:
    """``rank`` answered a secure step with an ``error`` reply (its task raised).

    With ``[strategy] accept_failures = true`` (the default) that costs the rank
    its clients for this round, named with the reason in their ``not_served`` and
    in the round's ``failed``; it is not declared dead, so it plays again next
    round, until the round skeleton's strikes quarantine it as on every other
    path. ``false`` ends the run with the rank's error.
    """
    if not accept_failures:
        raise WorkerError(rank, error)
    log.warning("rank %d failed a secure round step; its clients leave the round: %s",
                rank, error)
    lost.setdefault(rank, f"failed: {error}")
    # The round skeleton reports and strikes a round's call failures (meshkit.train._rounds).
    ctx.call_failures.setdefault(rank, f"error: {error}")


def secure_sum(ctx: StrategyContext, clients: Sequence[int], *, state: Mapping[str, Any],
               scheme: SchemeChoice, rnd: int, shards: int, seeds: Mapping[int, int],
               fit: Mapping[str, Any] | None = None,
               pinned: Mapping[int, int] | None = None,
               accept_failures: bool = True,
               noise: Callable[[RoundParams, int], SkellamPlan] | None = None,
               noise_source: str = "os") -> SecureSum:
    """One secure round over the live workers (module docstring).

    ``clients`` is the round's cohort, ``scheme`` the run's
    ``[secure_aggregation]``, ``seeds[c]`` client c's fit seed,
    ``shards`` how many clients the run has (a fit's ``shards``), ``fit``
    extra fields of every client's fit (``time_budget``, ``clip_norm``),
    ``pinned[c]`` the only rank that may play client c (its data is there:
    ``[partitioner] name = "local"``), ``accept_failures`` (``[strategy]``)
    whether a rank's ``error`` reply costs its clients the round (true) or
    ends the run (false, :class:`~meshkit.WorkerError`). ``noise``
    (``[privacy] placement = "distributed"``): called with the round's
    parameters and the update's length before any request, it gives the
    round's :class:`~meshkit.privacy.SkellamPlan`; each client then puts its
    update on that grid and adds its Skellam share itself (``noise_source``
    "os" or "seeded"), and the sum is decoded by the plan.
    Raises :class:`~meshkit.RefusedError` when the round cannot be unmasked
    without weakening the guarantee (too few clients left at any step).
    """
    cohort = sorted(clients)
    live = ctx.live
    if not live:
        raise RefusedError("[secure_aggregation]: no live worker to play the round's clients")
    # The round's public seed comes first: a scheme with the trait interleave orders the
    # cohort by it, and the ranks play the clients round-robin in that order.
    round_seed = secrets.token_bytes(SEED_SIZE)
    interleave = pinned is None and scheme.traits.interleave
    plan = plan_cohort(cohort, live, pinned,
                       interleaved_order(scheme, cohort, round_seed) if interleave else None)
    compression: CompressionPlan | None = ctx.compression
    input_bits = _input_bits(compression)
    params = round_params(scheme, len(cohort), per_worker=max(map(len, plan.values())),
                          input_bits=input_bits, interleave=len(plan) if interleave else 0)
    traits = scheme.traits
    keys = vector_keys(state)
    length = int(sum(np.asarray(state[k]).size for k in keys))
    if noise is not None and compression is not None:
        raise RefusedError("[secure_aggregation]: a distributed-DP round's clients put their "
                           "updates on the Skellam grid themselves; [compression] would put "
                           "them on its own")
    if length == 0:
        raise RefusedError("[secure_aggregation]: the model has no floating-point arrays to "
                           "sum; a secure round has nothing to hide or to average")
    plan_noise = None if noise is None else noise(params, length)
    lost: dict[int, str] = {}
    # A bad unmasking share is searched for by rank: a worker playing several clients
    # could otherwise hide one bad share behind another.
    server = scheme.scheme.server(params, cohort, round_seed, length,
                                  {c: r for r, cs in plan.items() for c in cs})

    def call(requests: dict[int, dict[str, Any]]) -> dict[int, Mapping[str, Any]]:
        """Each still-live planned rank's reply; the lost ones are recorded as such."""
        alive = set(ctx.live)
        sent = [(r, q) for r, q in sorted(requests.items()) if r in alive and r not in lost]
        for rank in sorted(set(requests) - alive - set(lost)):
            lost[rank] = ctx.pool.dead.get(rank, "lost")
        answers = {}
        for reply in pool_call(ctx.pool, sent, ctx.timeout):
            if reply.payload is None:
                lost[reply.rank] = reply.error or "lost"
            elif reply.payload.get("error"):
                _failed(ctx, reply.rank, str(reply.payload["error"]), lost, accept_failures)
            else:
                answers[reply.rank] = reply.payload
        return answers

    call({r: {"op": "set_state", "state": state} for r in plan})
    # The default scheme goes unnamed: the keys request is then what it was before schemes
    # were plugins, so a worker of that version still plays it.
    named: dict[str, Any] = ({} if scheme.name == DEFAULT_SECURE_AGGREGATION
                             else {"scheme": scheme.name})
    if input_bits:
        named["input_bits"] = input_bits
    replies = call({r: {"op": "secagg_keys", "round": rnd, "clients": cs,
                        "cohort": params.clients, "degree": params.degree,
                        "threshold": params.threshold, "clip_range": params.clip_range,
                        "modulus_bits": params.modulus_bits,
                        "round_seed": np.frombuffer(round_seed, np.uint8)[None, :],
                        "length": length, **named} for r, cs in plan.items()})
    rows_of: dict[int, np.ndarray] = {}
    signed_by: dict[int, tuple[bytes, bytes]] = {}  # client -> (signer, advert signature)
    for rank, reply in replies.items():
        try:
            if list(reply["clients"]) != plan[rank]:
                raise ProtocolError(f"keys for clients {list(reply['clients'])}, not for the "
                                    f"{plan[rank]} it plays")
            _expect(reply["adverts"], traits.advert_size, "advert")
            signed_by.update(_advert_signatures(reply, plan[rank], round_seed, rnd, rank,
                                                ctx.authorized_nodes))
            for client, row in zip(plan[rank], reply["adverts"]):
                server.receive_advert(client, bytes(row))
                rows_of[client] = row
        except ProtocolError as exc:
            _bad(ctx, rank, exc, lost)
    members = server.members()
    rosters = set(members)
    everyone = np.stack([rows_of[c] for c in members])
    advertised = {r: [c for c in cs if c in rosters] for r, cs in plan.items()}
    # A signed round: every member's advert came signed, and the signatures go with the
    # adverts (an unsigned one as zeros, which a worker with a roster refuses, naming it).
    signed = bool(members) and all(c in signed_by for c in members)
    unsigned = (bytes(32), bytes(64))
    sharing_keys: dict[str, Any] = {} if not signed_by else {
        "signers": _stack([signed_by.get(c, unsigned)[0] for c in members], 32),
        "signatures": _stack([signed_by.get(c, unsigned)[1] for c in members], 64)}
    replies = call({r: {"op": "secagg_share", "members": members, "adverts": everyone,
                        **sharing_keys}
                    for r, cs in advertised.items() if cs})
    for rank, reply in replies.items():
        try:
            _expect(reply["sealed"], traits.sealed_size, "sealed")
            bundles: dict[int, list[tuple[int, bytes]]] = {c: [] for c in advertised[rank]}
            for sender, recipient, row in zip(reply["senders"], reply["recipients"],
                                              reply["sealed"]):
                if sender not in bundles:
                    raise ProtocolError(f"shares sealed by client {sender}, which it does not "
                                        f"play")
                bundles[sender].append((int(recipient), bytes(row)))
            for client, shares in bundles.items():
                server.receive_shares(client, shares)
        except ProtocolError as exc:
            _bad(ctx, rank, exc, lost)
    deliveries = server.deliveries()
    sharing = {r: [c for c in cs if c in deliveries] for r, cs in advertised.items()}
    opening = {}
    for rank, cs in sharing.items():
        if not cs:
            continue
        rows = [(sender, c, sealed) for c in cs for sender, sealed in deliveries[c]]
        opening[rank] = {
            "op": "secagg_open", "clients": cs, "senders": [s for s, _, _ in rows],
            "recipients": [r for _, r, _ in rows],
            "sealed": (np.frombuffer(b"".join(b for _, _, b in rows), np.uint8).reshape(
                len(rows), traits.sealed_size) if rows
                else np.zeros((0, traits.sealed_size), np.uint8))}
    accusations: list[tuple[int, int]] = []
    for rank, reply in call(opening).items():
        try:
            pairs = [(int(s), int(r)) for s, r in zip(reply["senders"], reply["recipients"])]
            for sender, recipient in pairs:
                if recipient not in sharing[rank] or not any(
                        row[0] == sender for row in deliveries[recipient]):
                    raise ProtocolError(f"an accusation of client {sender} by client "
                                        f"{recipient}, which it did not deliver to")
            accusations.extend(pairs)
        except ProtocolError as exc:
            _bad(ctx, rank, exc, lost)
    where = {c: r for r, cs in plan.items() for c in cs}
    excluded = (_settle(ctx, server, accusations, where, plan, lost, call, traits)
                if accusations else ())
    gone = set(excluded)
    masking = {}
    for rank, cs in sharing.items():
        cs = [c for c in cs if c not in gone]
        if cs:
            masking[rank] = {"op": "secagg_mask", "clients": cs,
                             "seeds": [int(seeds[c]) for c in cs], "shards": shards,
                             "excluded": list(excluded), **(fit or {})}
            if compression is not None:
                masking[rank]["compress"] = compression.request()
            if plan_noise is not None:
                masking[rank].update(ddp_request(plan_noise, noise_source))
    _masked_step(ctx, server, masking, sharing, params.modulus_bits, lost, accept_failures)
    if not traits.tolerates_dropouts:
        _refuse_dropouts(scheme.name, cohort, plan, lost, rosters, gone)
    told = server.unmasking()  # refuses below the threshold, before any share moves
    requests = set(told.holders)
    asked = {r: [c for c in cs if c in requests] for r, cs in sharing.items()}
    asked = {r: cs for r, cs in asked.items() if cs}
    confirmations = (_confirm_step(ctx, call, asked, told, signed_by, round_seed, rnd, lost)
                     if signed else {})
    replies = call({r: {"op": "secagg_unmask", "clients": cs,
                        "survivors": list(told.survivors), "dropped": list(told.dropped),
                        **confirmations}
                    for r, cs in asked.items()})
    for rank, reply in replies.items():
        try:
            _expect(reply["shares"], traits.share_size, "unmasking share")
            for holder in sorted(set(reply["holders"])):
                if holder not in requests or holder not in sharing[rank]:
                    raise ProtocolError(f"unmasking shares of client {holder}, which it does "
                                        f"not play among the survivors")
            mine = [c for c in sharing[rank] if c in requests]
            held: dict[int, list[tuple[int, int, bytes]]] = {c: [] for c in mine}
            for h, o, k, s in zip(reply["holders"], reply["owners"], reply["kinds"],
                                  reply["shares"]):  # one pass, not one per holder
                held[int(h)].append((int(o), int(k), bytes(s)))
            for holder in mine:
                server.receive_unmask(holder, held[holder])
        except ProtocolError as exc:
            _bad(ctx, rank, exc, lost)
    result = _finish(ctx, server, sharing, lost)
    if plan_noise is not None:
        total = plan_noise.decode(result.total, len(result.contributors))
    elif compression is not None:
        total = decode_field_sum(compression.compressor, result.total,
                                 clip_range=params.clip_range, count=len(result.contributors))
    else:
        total = scheme.scheme.dequantize(result.total, params, len(result.contributors))
    summed: dict[str, np.ndarray] = {}
    offset = 0
    for key in keys:
        size = np.asarray(state[key]).size
        summed[key] = total[offset:offset + size].reshape(np.shape(state[key]))
        offset += size
    served = {c: where[c] for c in result.contributors}
    not_served = {c: _why(c, where[c], lost, rosters, deliveries, gone)
                  for c in cohort if c not in served}
    return SecureSum(summed, tuple(result.contributors), served, not_served, params,
                     result.total, dropped=tuple(result.dropped), noise=plan_noise)


def ddp_request(plan: SkellamPlan, source: str) -> dict[str, Any]:
    """The ``secagg_mask`` fields that tell each client the round's Skellam grid and share."""
    return {"ddp_scale": float(plan.scale), "ddp_variance": float(plan.variance),
            "ddp_bound": float(plan.bound), "ddp_half": int(plan.half), "ddp_noise": source}


def _stack(rows: Sequence[bytes], width: int) -> np.ndarray:
    return (np.frombuffer(b"".join(rows), np.uint8).reshape(len(rows), width) if rows
            else np.zeros((0, width), np.uint8))


def _advert_signatures(reply: Mapping[str, Any], clients: Sequence[int], round_seed: bytes,
                       rnd: int, rank: int, authorized: AuthorizedNodes | None
                       ) -> dict[int, tuple[bytes, bytes]]:
    """A keys reply's advert signatures (none when it is unsigned), each checked against the
    key the reply names, and that key against the coordinator's ``[mesh] authorized_nodes``
    (when it has one: listed, not revoked, not bound to another rank): either failing is
    the rank's breach."""
    if reply.get("signer") is None:
        return {}
    signer = bytes(reply["signer"][0])
    problem = None if authorized is None else authorized.problem(signer, rank)
    if problem is not None:
        raise SignatureError(
            f"round {rnd}: rank {rank}'s adverts (clients {list(clients)}) are signed by a key "
            f"the coordinator's [mesh] authorized_nodes does not admit for rank {rank}: "
            f"{problem}. A signed round takes only adverts signed by the node key a rank is "
            f"admitted with; the rank's clients leave the round", clients[0])
    adverts = {c: bytes(row) for c, row in zip(clients, reply["adverts"])}
    signatures = {c: bytes(row) for c, row in zip(clients, reply["signatures"])}
    check_adverts(Roster(frozenset([signer]), "the keys reply"), round_seed, rnd, adverts,
                  dict.fromkeys(clients, signer), signatures, blame=True)
    return {c: (signer, signatures[c]) for c in clients}


def _confirm_step(ctx: StrategyContext, call: Any, asked: Mapping[int, list[int]], told: Any,
                  signed_by: Mapping[int, tuple[bytes, bytes]], round_seed: bytes, rnd: int,
                  lost: dict[int, str]) -> dict[str, Any]:
    """The consistency check's collection (``secagg_confirm``): every asked survivor's
    signature of the sets, checked under the key that signed its advert; the unmask
    request's ``confirmed``, ``confirm_signers`` and ``confirm_signatures``."""
    replies = call({r: {"op": "secagg_confirm", "clients": cs,
                        "survivors": list(told.survivors), "dropped": list(told.dropped)}
                    for r, cs in asked.items()})
    got: dict[int, tuple[bytes, bytes]] = {}
    for rank, reply in replies.items():
        try:
            if list(reply["clients"]) != asked[rank]:
                raise ProtocolError(f"confirmations of clients {list(reply['clients'])}, not "
                                    f"of the {asked[rank]} it was asked for")
            signer = bytes(reply["signer"][0])
            messages = confirm_messages(round_seed, rnd, asked[rank], told.survivors,
                                        told.dropped)
            for client, row in zip(asked[rank], reply["signatures"]):
                if signer != signed_by[client][0] or not verify(signer, bytes(row),
                                                                messages[client]):
                    raise ProtocolError(f"client {client}'s confirmation of the survivor set "
                                        f"does not verify under the key that signed its advert")
                got[client] = (signer, bytes(row))
        except ProtocolError as exc:
            _bad(ctx, rank, exc, lost)
    ids = sorted(got)
    return {"confirmed": ids, "confirm_signers": _stack([got[c][0] for c in ids], 32),
            "confirm_signatures": _stack([got[c][1] for c in ids], 64)}


def _masked_step(ctx: StrategyContext, server: SchemeServer,
                 masking: Mapping[int, Mapping[str, Any]], sharing: Mapping[int, list[int]],
                 bits: int, lost: dict[int, str], accept_failures: bool) -> None:
    """Step 4: each worker's masked sum into ``server``, through its host relay when one
    carries several of the round's workers (one ``masked_sum`` relay request each)."""
    alive = set(ctx.live)
    for rank in sorted(set(masking) - alive - set(lost)):
        lost[rank] = ctx.pool.dead.get(rank, "lost")
    asked = {r: q for r, q in masking.items() if r in alive and r not in lost}
    owner = {r: name for name, rs in ctx.pool.relays.items() for r in rs}
    groups: dict[str, list[int]] = {}
    for rank in sorted(asked):
        if rank in owner:
            groups.setdefault(owner[rank], []).append(rank)
    groups = {name: ranks for name, ranks in groups.items() if len(ranks) > 1}
    grouped = {r for ranks in groups.values() for r in ranks}
    tickets: dict[int, tuple[str, list[int]]] = {}  # ticket -> (relay or "", ranks)
    for rank in sorted(set(asked) - grouped):
        tickets[ctx.pool.send(rank, asked[rank], ctx.timeout)] = ("", [rank])
    for name, ranks in sorted(groups.items()):
        request = masked_sum_request({r: asked[r] for r in ranks}, bits, ctx.timeout)
        tickets[ctx.pool.send_relay(name, request, ctx.timeout)] = (name, ranks)
    for _ in range(len(tickets)):
        reply = ctx.pool.receive()
        assert reply is not None  # a blocking receive always returns one
        name, ranks = tickets[reply.seq]
        if reply.payload is None:
            for rank in ranks:
                lost.setdefault(rank, reply.error or "lost")
            continue
        if reply.payload.get("error"):
            failed = int(reply.payload.get("rank") or ranks[0])
            _failed(ctx, failed, str(reply.payload["error"]), lost, accept_failures)
            if name:  # a relay answers with one rank's error: its sum of the others is lost
                for rank in ranks:
                    lost.setdefault(rank, f"its relay {name}'s sum was lost with rank "
                                          f"{failed}'s error")
            continue
        vector: np.ndarray | None
        try:
            if not name:
                ids = tuple(reply.payload["clients"])
                vector = _vector(reply.payload, bits)
            else:
                clients, vector, gone = parse_masked_sum_answer(
                    reply.payload, sorted(c for r in ranks for c in sharing[r]), bits)
                for rank, why in gone:
                    if rank in ranks and why.startswith("failed: "):
                        _failed(ctx, rank, why.removeprefix("failed: "), lost, accept_failures)
                    elif rank in ranks:
                        lost.setdefault(rank, why)
                ids = tuple(clients)
                if vector is None:
                    continue
            if not set(ids) <= {c for r in ranks for c in sharing[r]}:
                raise ProtocolError(f"a masked input of clients {list(ids)}, not of the "
                                    f"{sorted(c for r in ranks for c in sharing[r])} it was "
                                    f"asked to mask")
            server.receive_masked(ids, vector)
        except ProtocolError as exc:
            for rank in ranks:  # a relay's sum cannot be split: its ranks go together
                _bad(ctx, rank, exc, lost)


def _vector(message: Mapping[str, Any], bits: int) -> np.ndarray:
    """A masked reply's vector, unpacked (:func:`~meshkit.secure_aggregation.from_wire`), or
    the sender is in breach."""
    try:
        return from_wire(message, bits)
    except ValueError as exc:
        raise ProtocolError(f"a masked vector that does not fit the field: {exc}") from None


def _expect(rows: np.ndarray, width: int, what: str) -> None:
    """A rank's rows are the width the scheme declares, or the rank is in breach."""
    if rows.shape[1] != width:
        raise ProtocolError(f"{what} rows {rows.shape[1]} bytes wide; the round's scheme "
                            f"declares {width}")


def _refuse_dropouts(name: str, cohort: Sequence[int], plan: Mapping[int, list[int]],
                     lost: Mapping[int, str], members: set[int], excluded: set[int]) -> None:
    """A scheme without ``tolerates_dropouts``: a round that lost a client after it
    advertised (a member the others mask with) is not unmasked."""
    gone = sorted({c for r in lost for c in plan.get(r, []) if c in members} | excluded)
    if gone:
        why = "; ".join(f"rank {r}: {lost[r]}" for r in sorted(lost))
        raise RefusedError(
            f"[secure_aggregation]: scheme {name!r} cannot unmask a round that lost clients "
            f"{gone} of {len(cohort)} ({why or 'taken out before masking'}): it lacks the "
            f"trait SecureAggregationTraits.tolerates_dropouts (its masks cancel only in the "
            f"full sum). Select a scheme that tolerates dropouts (e.g. secagg+) or keep every "
            f"worker alive")


def _settle(ctx: StrategyContext, server: SchemeServer, accusations: Sequence[tuple[int, int]],
            where: Mapping[int, int], plan: Mapping[int, list[int]], lost: dict[int, str],
            call: Any, server_traits: SecureAggregationTraits) -> tuple[int, ...]:
    """Accusations (sender, recipient: "its shares do not open") settled before anyone masks.

    Each accused sealer's rank is asked for the ephemeral keys it sealed
    those shares with (``secagg_reveal``), and the scheme server's ``judge``
    opens each share the coordinator routed: the sealer's rank is at fault
    when it reveals nothing or a key under which the share does not open,
    the accuser's when the share opens. The rank at fault is declared dead
    with the reason and all its clients are taken out of the round
    (its ``exclude``): nobody masks with them. Returns every
    client taken out.
    """
    by_rank: dict[int, list[tuple[int, int]]] = {}
    for sender, recipient in accusations:
        by_rank.setdefault(where[sender], []).append((sender, recipient))
    revealed = call({r: {"op": "secagg_reveal", "senders": [s for s, _ in pairs],
                         "recipients": [v for _, v in pairs]}
                     for r, pairs in by_rank.items()})
    faulty: dict[int, str] = {}
    for rank, pairs in sorted(by_rank.items()):
        keys = revealed.get(rank, {}).get("keys")
        if keys is not None and keys.shape[1] != server_traits.reveal_size:
            _bad(ctx, rank, ProtocolError(f"revealed keys {keys.shape[1]} bytes wide; the "
                                          f"round's scheme declares "
                                          f"{server_traits.reveal_size}"), lost)
            keys = None
        if keys is not None and len(keys) != len(pairs):
            _bad(ctx, rank, ProtocolError(f"{len(keys)} revealed keys for {len(pairs)} accused "
                                          f"shares"), lost)
            keys = None
        for i, (sender, recipient) in enumerate(pairs):
            key = None if keys is None else bytes(keys[i])
            if server.judge(sender, recipient, key) == sender:
                faulty.setdefault(rank, f"client {sender}'s shares for client {recipient} do not "
                                        f"open under the key it revealed")
            else:
                faulty.setdefault(where[recipient], f"client {recipient} accused client "
                                                    f"{sender} of shares that do open")
    for rank, why in sorted(faulty.items()):
        log.warning("rank %d is at fault in a secure round: %s", rank, why)
        if rank in set(ctx.live):
            _bad(ctx, rank, ProtocolError(why), lost)
        else:
            lost.setdefault(rank, f"protocol error: {why}")
    return server.exclude([c for r in faulty for c in plan[r]])


def _finish(ctx: StrategyContext, server: SchemeServer, sharing: Mapping[int, list[int]],
            lost: dict[int, str]) -> Any:
    """``server.finish()``, dropping each holder whose share fails its owner's commitment."""
    owner = {c: r for r, cs in sharing.items() for c in cs}
    for _ in range(len(owner) + 1):  # each retry has discarded one holder's reply
        try:
            return server.finish()
        except SecureAggregationError as exc:
            client = exc.client
            if client is None or client not in owner:
                raise
            _bad(ctx, owner[client], exc, lost)
    raise RefusedError("[secure_aggregation]: every unmasking share was refused")


def _why(client: int, rank: int, lost: Mapping[int, str], rosters: set[int],
         deliveries: Mapping[int, Any], excluded: set[int]) -> str:
    """Why ``client`` (played by ``rank``) is not in the round's sum."""
    if client not in rosters:
        step, cause = "before advertising keys", "its advert was refused"
    elif client not in deliveries:
        step, cause = "before sharing its secrets", "too few of its neighbours shared with it"
    elif client in excluded:
        step, cause = "before masking", "too few of its neighbours remained in the round"
    else:
        step = "before sending its masked input"
        cause = f"rank {rank} sent no masked input for it"
    if rank in lost:
        cause = (f"rank {rank} {lost[rank]}" if lost[rank].startswith("failed: ")
                 else f"rank {rank} was lost ({lost[rank]})")
    return f"dropped {step}: {cause}"
