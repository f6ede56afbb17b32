"""SecAgg+ as a :class:`meshkit.secure_aggregation.Scheme`: the kernel's round drives it.

Rule: this module is the whole of what the kernel sees of SecAgg+ -- bytes in
and out of :class:`ServerRound` and :class:`ClientRound`, the round's
parameters (``degree`` and ``threshold`` resolved for the cohort), the
quantisation, and what ``meshkit check`` shows. Rows on the wire: an advert
is the share key, the mask key and the seed commitment (96 bytes); a sealed
row one share pair under an ephemeral key (:data:`SEALED_SIZE`); an
unmasking row one Shamir share (:data:`SHARE_SIZE`); a revealed key one
X25519 private key (32 bytes).

``degree`` and ``threshold`` (``[secure_aggregation]``): ``"auto"`` degree
is :func:`choose_degree` for the cohort, tolerating :data:`AUTO_DROPOUT` of
it dropping and the loss of the worker that plays the most clients;
``"auto"`` threshold is a strict majority of the ``k + 1`` holders of each
client's shares (its neighbours and itself: ``(k + 1) // 2 + 1``); a fraction
is that share of the neighbours (rounded up).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Iterable, Mapping, Optional, Sequence

import attrs
import numpy as np

from meshkit import ConfigError
from meshkit.secure_aggregation import (SecureAggregationTraits, SecureResult, Unmasking,
                                        field_width)

from meshkit_secagg._client import ClientRound, cancelled_pairs
from meshkit_secagg._graph import neighbours, ring
from meshkit_secagg._interleave import interleaved_degree, survives
from meshkit_secagg._messages import (SEALED_SIZE, KeyAdvert, MaskedInput,
                                      MaskedSum, Roster, SealedShares, ShareBundle,
                                      ShareDelivery, UnmaskReply, UnmaskRequest)
from meshkit_secagg._params import MAX_CLIENTS, SecAggParams, choose_degree
from meshkit_secagg._quantize import dequantize, quantize
from meshkit_secagg._server import ServerRound
from meshkit_secagg._shamir import SHARE_SIZE
from meshkit_secagg.options import SecAggPlusOptions

__all__ = ["SecAggPlus", "AUTO_DROPOUT", "survivable_workers", "ADVERT_SIZE", "REVEAL_SIZE"]

#: The share of the cohort's droppable units (clients, or whole workers when a worker plays
#: several) ``degree = "auto"`` tolerates dropping (no colluders assumed).
AUTO_DROPOUT = 0.3
#: Bytes of one advert row: the share key, the mask key, the seed commitment.
ADVERT_SIZE = 3 * 32
#: Bytes of one revealed ephemeral X25519 private key.
REVEAL_SIZE = 32


@functools.lru_cache(maxsize=256)
def _auto_degree(clients: int, per_worker: int = 1, interleave: int = 0) -> tuple[int, int]:
    """``degree = "auto"``: the round survives :data:`AUTO_DROPOUT` of its droppable units dropping.

    What drops is what plays: a worker's clients leave a round together (its
    reply is one sum; any failure, breach or verdict takes out the rank), so
    with ``per_worker`` > 1 the unit is the worker. The cohort then spans at
    least ``w = ceil(clients / per_worker)`` workers, and the round must
    survive losing ``max(1, floor(AUTO_DROPOUT * w))`` of them in the worst
    case over the graph: every client keeps ``t`` of its ``k + 1`` holders
    when that many workers' clients, ``per_worker`` each at most, are gone
    (``k + 1 - t`` at least their number; :func:`survivable_workers`). With
    one client a worker, clients drop one by one, and :func:`choose_degree`
    bounds the chance that a random :data:`AUTO_DROPOUT` of them leaves a
    client too few holders. Either way the threshold stays a strict majority
    of the ``k + 1`` holders of each client's shares.

    At 100 clients that is 60, threshold 31, with one client a worker (at
    ``n = 100`` the ``2**-40`` bound is the worst case: 29 of the other 99
    dropped must leave a majority); over 4 workers it is 50, threshold 26
    (any one worker of 25 may drop). Random client dropouts do not happen
    there, so the 60 would buy nothing the round can use.

    ``interleave`` > 0: the kernel placed the cohort round-robin on that many
    workers along the graph's ring (the trait ``interleave``), so a member's
    neighbours are spread evenly over the workers and the degree is
    :func:`~meshkit_secagg._interleave.interleaved_degree`'s when it has one
    (8, threshold 5, at 100 clients over 4 workers).
    """
    if interleave and per_worker > 1:
        found = interleaved_degree(clients, interleave, AUTO_DROPOUT)
        if found is not None:
            return found
    if per_worker <= 1:
        degree, threshold = choose_degree(clients, dropout=AUTO_DROPOUT)
        k = clients - 1 if degree == 0 else degree
        return (0 if k >= clients - 1 else k), threshold
    workers = -(-clients // per_worker)
    lost = max(1, math.floor(AUTO_DROPOUT * workers)) * per_worker
    k = 2
    threshold = (k + 1) // 2 + 1
    while k + 1 - threshold < lost and k < clients - 1:
        k = min(k + 2, clients - 1)
        threshold = (k + 1) // 2 + 1
    return (0 if k >= clients - 1 else k), threshold


def survivable_workers(params: SecAggParams, loads: Sequence[int], interleave: int = 0) -> int:
    """How many workers a round survives losing at any step, in the worst case over its graph.

    ``loads`` are the clients each worker plays. A client's secrets have
    ``k + 1`` holders (its ``k`` neighbours and itself) and need ``t``: losing
    ``L`` clients leaves every client at least ``k + 1 - L`` holders (a lost
    client's own share is lost with it, but it is then one of the ``L``), so
    any set of workers whose clients number at most ``k + 1 - t`` may be
    lost: the count of the largest loads that fit that budget.
    """
    if interleave > 1 and max(loads, default=0) > 1:
        # Round-robin along the ring: count exactly what each number of lost workers costs.
        workers = len(loads)
        survived = 0
        for lost in range(1, workers):
            if not survives(params.clients, workers, params.effective_degree,
                            params.threshold, lost):
                break
            survived = lost
        return survived
    budget = params.effective_degree + 1 - params.threshold
    lost = survived = 0
    for load in sorted(loads, reverse=True):
        if lost + load > budget:
            break
        lost += load
        survived += 1
    return min(survived, max(len(loads) - 1, 0))


def _advert(client: int, row: bytes) -> KeyAdvert:
    return KeyAdvert(client, row[:32], row[32:64], row[64:ADVERT_SIZE])


class _Server:
    """The coordinator's side: :class:`ServerRound` behind the kernel's byte rows."""

    def __init__(self, round_: ServerRound) -> None:
        self.round = round_

    def receive_advert(self, client: int, advert: bytes) -> None:
        self.round.receive_advert(_advert(client, advert))

    def members(self) -> list[int]:
        return sorted(self.round.rosters())

    def receive_shares(self, client: int, rows: Sequence[tuple[int, bytes]]) -> None:
        self.round.receive_shares(ShareBundle(client, tuple(
            SealedShares(client, int(recipient), bytes(sealed)) for recipient, sealed in rows)))

    def deliveries(self) -> dict[int, list[tuple[int, bytes]]]:
        return {c: [(s.sender, s.sealed) for s in d.shares]
                for c, d in self.round.deliveries().items()}

    def judge(self, sender: int, recipient: int, key: Optional[bytes]) -> int:
        return self.round.judge(sender, recipient, key)

    def exclude(self, clients: Iterable[int]) -> tuple[int, ...]:
        return self.round.exclude(clients)

    def receive_masked(self, clients: tuple[int, ...], vector: np.ndarray) -> None:
        self.round.receive_masked(MaskedInput(clients[0], vector) if len(clients) == 1
                                  else MaskedSum(clients, vector))

    def unmasking(self) -> Unmasking:
        requests = self.round.unmask_requests()  # refuses below the threshold
        told = next(iter(requests.values()))  # every survivor is told the same two sets
        return Unmasking(tuple(requests), told.survivors, told.dropped)

    def receive_unmask(self, holder: int, rows: Sequence[tuple[int, int, bytes]]) -> None:
        self.round.receive_unmask(UnmaskReply(
            holder, tuple((o, s) for o, k, s in rows if k == 0),
            tuple((o, s) for o, k, s in rows if k == 1)))

    def finish(self) -> SecureResult:
        result = self.round.finish()
        return SecureResult(result.total, tuple(result.contributors), tuple(result.dropped))


class _Client:
    """One client's side: :class:`ClientRound` behind the kernel's byte rows."""

    def __init__(self, round_: ClientRound, client: int, params: SecAggParams,
                 round_seed: bytes) -> None:
        self.round = round_
        self.client = client
        self.params = params
        self.seed = round_seed
        #: Sharers whose masks cancel in the party's sum (:meth:`_Party.summing`).
        self.cancelled: frozenset[int] = frozenset()
        #: The other clients its worker plays (:class:`_Party`): their shares are read, not opened.
        self.peers: Mapping[int, ClientRound] = {}

    def advertise(self) -> bytes:
        advert = self.round.advertise()
        return advert.share_key + advert.mask_key + advert.seed_commitment

    def share(self, members: Sequence[int], adverts: Mapping[int, bytes]
              ) -> list[tuple[int, bytes]]:
        graph = neighbours(self.seed, members, self.params.degree)  # drawn once a round
        roster = Roster(self.client, tuple(members),
                        tuple(_advert(v, adverts[v]) for v in graph[self.client]))
        return [(row.recipient, row.sealed) for row in self.round.share(roster).shares]

    def open(self, delivered: Sequence[tuple[int, bytes]]) -> tuple[int, ...]:
        rows = sorted((SealedShares(int(s), self.client, bytes(b)) for s, b in delivered),
                      key=lambda s: s.sender)
        return self.round.open(ShareDelivery(self.client, tuple(rows)), self.peers)

    def reveal(self, recipient: int) -> bytes:
        return self.round.reveal(recipient)

    def mask(self, quantised: np.ndarray, excluded: Sequence[int]) -> np.ndarray:
        masked: MaskedInput = self.round.mask_opened(quantised, list(excluded), self.cancelled)
        return masked.vector

    def unmask(self, survivors: Sequence[int], dropped: Sequence[int]
               ) -> list[tuple[int, int, bytes]]:
        reply = self.round.unmask(UnmaskRequest(self.client, tuple(survivors), tuple(dropped)))
        return [(int(owner), kind, share)
                for kind, pairs in ((0, reply.seed_shares), (1, reply.key_shares))
                for owner, share in pairs]


class _Party:
    """The clients one worker plays in a round (the trait ``party``): its masked reply is one sum.

    In that sum the pairwise mask of two of its clients is added by one and
    subtracted by the other, so neither expands it nor agrees its seed
    (:func:`cancelled_pairs`): the same bits, half the pairwise work at two
    workers. The clients drop together or not at all, since the sum is one
    reply, so the coordinator never has such a pair to cancel. And a share
    one of them sealed to another, delivered as sealed, is read from its
    sealer rather than decrypted (:meth:`ClientRound.open`'s ``peers``).
    """

    def __init__(self, clients: Mapping[int, _Client]) -> None:
        self._clients = dict(clients)
        rounds = {c: side.round for c, side in self._clients.items()}
        for side in self._clients.values():
            side.peers = rounds

    @property
    def clients(self) -> Mapping[int, _Client]:
        return self._clients

    def summing(self, clients: Sequence[int]) -> None:
        cancelled = cancelled_pairs({c: self._clients[c].round for c in clients})
        for side in self._clients.values():
            side.cancelled = frozenset()
        for client, pairs in cancelled.items():
            self._clients[client].cancelled = pairs


@attrs.frozen
class SecAggPlus:
    """SecAgg+ (Bell et al. 2020) over a k-regular Harary graph; ``degree = 0`` is SecAgg."""

    options: SecAggPlusOptions = attrs.Factory(SecAggPlusOptions)

    @property
    def traits(self) -> SecureAggregationTraits:
        return SecureAggregationTraits(
            modulus_bits=self.options.modulus_bits, advert_size=ADVERT_SIZE,
            sealed_size=SEALED_SIZE, share_size=SHARE_SIZE, reveal_size=REVEAL_SIZE,
            tolerates_dropouts=True, threshold=True, max_clients=MAX_CLIENTS,
            integer_inputs=True, party=True, interleave=self.options.interleave)

    def order(self, round_seed: bytes, cohort: Sequence[int]) -> tuple[int, ...]:
        """The cohort along the round's ring (the trait ``interleave``: the kernel places it
        round-robin on its workers in this order)."""
        return ring(round_seed, cohort)

    def plan(self, clients: int, per_worker: int = 1, input_bits: int = 0,
             interleave: int = 0) -> SecAggParams:
        """The round's :class:`SecAggParams` for a cohort of ``clients`` (module docstring).

        ``per_worker`` is the most clients one worker plays this round (what
        ``degree = "auto"`` must survive losing). ``input_bits`` > 0: the inputs
        are a compressor's codes below ``2**input_bits``, masked in the narrowest
        field their sum fits (:func:`meshkit.secure_aggregation.field_width`)
        instead of ``modulus_bits``. ``interleave`` > 0: the kernel placed the
        cohort round-robin on that many workers in :meth:`order`'s order.
        """
        opts = self.options
        auto_t = None
        if opts.degree == "auto":
            degree, auto_t = _auto_degree(clients, per_worker, interleave)
        else:
            degree = int(opts.degree)
        probe = SecAggParams(clients=clients, degree=degree, threshold=1,
                             clip_range=opts.clip_range,
                             modulus_bits=(field_width(input_bits, clients) if input_bits
                                           else opts.modulus_bits),
                             input_bits=input_bits)
        neighbours_ = probe.effective_degree
        if opts.threshold == "auto":
            threshold = auto_t if auto_t is not None else (neighbours_ + 1) // 2 + 1
        elif isinstance(opts.threshold, float):
            threshold = max(1, math.ceil(opts.threshold * neighbours_))
        else:
            threshold = int(opts.threshold)
        if threshold > neighbours_:
            raise ConfigError(
                f"[secure_aggregation] threshold = {opts.threshold!r}: {threshold} shares are "
                f"needed but each of this round's {clients} clients has {neighbours_} "
                f"neighbours to hold them (degree = {opts.degree!r}); lower threshold, raise "
                f"degree (0: the complete graph), or sample more clients")
        return attrs.evolve(probe, threshold=threshold)

    def params(self, *, clients: int, degree: int, threshold: int, clip_range: float,
               modulus_bits: int, input_bits: int = 0) -> SecAggParams:
        return SecAggParams(clients=clients, degree=degree, threshold=threshold,
                            clip_range=clip_range, modulus_bits=modulus_bits,
                            input_bits=input_bits)

    def describe(self, params: SecAggParams, loads: Sequence[int],
                 interleave: int = 0) -> dict[str, Any]:
        return {"degree": params.effective_degree, "threshold": params.threshold,
                "survives_losing_workers": survivable_workers(params, loads, interleave),
                "survives_losing_clients": params.effective_degree + 1 - params.threshold}

    def server(self, params: SecAggParams, cohort: Sequence[int], round_seed: bytes,
               length: int, groups: Mapping[int, int]) -> _Server:
        return _Server(ServerRound(params, cohort, round_seed, length, groups=groups))

    def client(self, params: SecAggParams, client: int, round_seed: bytes,
               length: int) -> _Client:
        return _Client(ClientRound(params, client, round_seed, length), client, params,
                       round_seed)

    def party(self, params: SecAggParams, clients: Sequence[int], round_seed: bytes,
              length: int) -> _Party:
        return _Party({c: self.client(params, c, round_seed, length) for c in clients})

    def quantize(self, values: np.ndarray, params: SecAggParams) -> np.ndarray:
        return quantize(values, params)

    def dequantize(self, total: np.ndarray, params: SecAggParams,
                   contributors: int) -> np.ndarray:
        return dequantize(total, params, contributors)
