"""A compressed round on the coordinator: the fits it asks for, its decoder, and its batches.

Each contribution crosses the wire compressed once. Which way a compressed round is
played (:data:`~meshkit.train._rounds.engine.ROUND_PATHS`):

* **batched** (:func:`fold_compressed_batched`), when the aggregator is linear (the
  strict mean) and there are at least two fits a worker, and nothing needs a single
  contribution in key order (no deadline, pinned work, attack, FedBN local keys, given
  fold, host relay): one ``fit_batch`` request per batch of clients, as the
  uncompressed batched round (:mod:`.batched`), asking for ``compress``. The worker fits
  its clients in turn and answers with each client's compressed payload, in order; the
  coordinator decodes and folds the payloads one at a time, a chunk at a time, into one
  exact sum (:class:`meshkit.compression.CompressedSum`: no float copy of a
  contribution, and the same bits whichever worker served which client, in whatever
  order the replies came). Error-feedback residuals go to the client-local store as each
  payload is folded. A batch is cut as the uncompressed batched round's, and so that its
  payloads (by the compressor's ``bounds``) are at most ``window`` whole contributions'
  bytes or :data:`BATCH_BYTES`, whichever is more: with one request in flight per
  worker, the coordinator holds at most that per worker besides the sums.
  What was folded stays folded when its worker is lost later; a payload that does not
  fit, does not decode or is not finite costs its rank (or, on a second rank, its
  client), and the rest of its batch is served again.
  With ``[compression] clip_range`` (a dense ``integer_field`` compressor) a worker
  answers instead with **one** exact integer sum of its clients' codes on the shared
  grid, weighed by examples (or once), kept across its batches and pulled once
  (``take_partial``, as the uncompressed batched round's partial), which the
  coordinator merges into its own (:class:`meshkit.compression.CodeSum`,
  ``_GridBatched``): about one compressed model a worker crosses the wire, not one a
  client, and the result is the bits of adding each client's codes at the
  coordinator. A sum that does not fit costs its rank, and its clients are served
  again. Behind host relays the round is played the same way, and each relay adds
  its ranks' sums (``grid_sum``, :mod:`meshkit.train._relay.grid`) and sends one up.
* **flat** otherwise (one fit a worker, a deadline, pinned work, FedBN local keys, host
  relays without ``clip_range``, ``batch=False``): each payload is pulled in key order.
  Under an exact weighted mean (:func:`flat_payload_fold`) it is summed as its turn comes
  into one :class:`~meshkit.compression.CompressedSum`, a chunk at a time (no float copy
  of a contribution; the bits of ``FixedPointSum`` over the decoded contributions, the
  batched round's), its client's own keys and residual kept in the client-local store
  once it is folded; a payload the sum refuses (does not decode, NaN, out of range) costs
  its sender's rank and leaves the sum as it was. Any other rule -- a robust one sees
  individual updates -- has each payload decoded whole as it is pulled (:class:`Unpacker`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import attrs
import numpy as np

from meshkit.aggregation import exact_mean
from meshkit.compression import (CodeSum, CompressedSum, CompressionPlan, compressed_keys,
                                 decode_contribution, is_residual, residual_name)
from meshkit.errors import AggregationError, MeshError, ProtocolError, WorkerError
from meshkit.train._local_keys import ClientLocal
from meshkit.train._messages import Signature, check_contribution, signature
from meshkit.train._pool import protocol_reason
from meshkit.train._rounds.batched import _Batched, batch_applies
from meshkit.train._rounds.pins import ResidualPins
from meshkit.train._relay.grid import grid_sum_request, parse_grid_sum_answer
from meshkit.train._rounds.relayed import relay_groups, relay_plan_applies, relay_weight
from meshkit.train._rounds.scheduler import small_reply
from meshkit.train._strategy import StrategyContext
from meshkit.train._worker.held import by_key
from meshkit.train._rounds.work import Folded, Work, by_examples

__all__ = ["compressed_work", "Unpacker", "fold_compressed_batched", "batch_size_bound",
           "compressed_batch_applies", "play_compressed_batched", "flat_payload_fold",
           "PayloadFold"]

log = logging.getLogger(__name__)
#: The run's topic (``StrategyContext.said``) for a ``clip_range`` a round could not use:
#: a run says so once, not every round.
UNGRIDDED = "compression.clip_range unused"


def compressed_work(ctx: StrategyContext, work: Sequence[Work], state: Mapping[str, Any],
                    local: ClientLocal | None
                    ) -> tuple[list[Work], ClientLocal | None, Unpacker]:
    """``work`` asking for compressed fits (``compress``), the store their local keys and
    residuals are kept in, and the round's decoder.

    Sent whole: FedBN's local keys (a client's own, never aggregated) and the task's
    buffers (BatchNorm's statistics are estimates, not updates: a sparsified running
    variance breaks the normalisation, and they are small). With error feedback the
    store is the run's client-local store (FedBN's), whose keys then also name each
    compressed key's residual, and whose values travel with the client's fit -- unless
    ``[compression] residual = "worker"``: then each client is pinned to the worker that
    keeps its residual, and its request names only which fit left it (:mod:`.pins`).
    """
    plan: CompressionPlan = ctx.compression
    store = local if local else None
    own = {k for k in (store.keys if store is not None else ()) if not is_residual(k)}
    raw = sorted(own | (ctx.buffers & set(state)))
    if plan.residuals_travel:
        store = ctx.client_local
        store.keys = store.keys | {residual_name(k) for k in compressed_keys(state, raw)}
    field = plan.request(raw)
    pinned: dict[int, tuple[int, dict[str, Any]]] = {}
    if plan.worker_residual:
        if ctx.residual_pins is None:
            ctx.residual_pins = ResidualPins()
            if ctx.start_round:
                log.warning("[compression] residual = \"worker\": a resumed run's workers do "
                            "not hold the residuals the checkpoint's rounds left, so every "
                            "client's error feedback restarts from a zero residual "
                            "(docs/compression.md)")
        pinned = ctx.residual_pins.plan([(w.key, w.rank) for w in work], ctx.live)
    out = []
    for w in work:
        request = {**w.request, "compress": field}
        kept = store.of(w.key) if store is not None else {}
        if kept:
            request["local"] = {**kept, **dict(w.request.get("local") or {})}
        if w.key in pinned:
            rank, residual = pinned[w.key]
            request["compress"] = {**field, "residual": residual}
            w = attrs.evolve(w, rank=rank)
        out.append(attrs.evolve(w, request=request))
    return out, store, Unpacker(plan, tuple(raw), plan.residuals_travel)


@attrs.frozen
class Unpacker:
    """A compressed round's decoder: a pulled payload back to the contribution it stands for."""

    plan: CompressionPlan
    #: The keys sent whole (:func:`compressed_work`).
    raw: tuple[str, ...]
    #: Whether a payload carries its client's residuals (False: none, or its worker's).
    residuals: bool = True

    def decode(self, payload: Mapping[str, Any], reference: Mapping[str, Any],
               what: str) -> tuple[dict[str, Any], dict[str, Any]]:
        return decode_contribution(self.plan.compressor, payload, reference, raw=self.raw,
                                   what=what, residuals=self.residuals)


#: A compressed batch's payloads may take this many bytes even when ``window`` whole
#: models are fewer.
BATCH_BYTES = 4 << 20


def compressed_batch_applies(call: Any) -> bool:
    """Whether a round (a :class:`~meshkit.train._rounds.engine.RoundCall`) is a compressed
    round played batched (module docstring): compressed fits, a linear aggregator, at least
    two fits a worker, and nothing that needs single contributions in key order.

    A ``[compression] clip_range`` only such a round can use: when a compressed round
    with one is played another way, the run says so (a warning, once), so the shared grid
    never does nothing silently."""
    applies = _compressed_batch_applies(call)
    plan = call.ctx.compression if call.compressed is not None else None
    if not applies and plan is not None and plan.clip_range is not None \
            and UNGRIDDED not in call.ctx.said:
        call.ctx.said.add(UNGRIDDED)
        log.warning("[compression] clip_range = %s: a round of %s fits is not a linear batched round "
                    "(a robust or weighted-by-metric aggregator, a deadline, local keys, a "
                    "simulated attack, or one fit a worker), so each client uploads its "
                    "payload on its own grid and no worker sums codes (docs/compression.md, "
                    "\"One sum a worker\"); said once a run", plan.clip_range, call.label)
    return applies


def _compressed_batch_applies(call: Any) -> bool:
    if call.compressed is None or not call.batch or call.given is not None \
            or call.attack is not None or call.deadline or call.pinned \
            or call.state is None or call.reference is None:
        return False
    kept = [*(call.compressed[1].keys if call.compressed[1] is not None else ()),
            *(call.local.keys if call.local is not None else ())]
    if any(not is_residual(k) for k in kept):
        return False  # FedBN's own keys are kept per client, whole: the flat round
    how = relay_weight(call.weight, by_examples)
    mean = exact_mean(call.ctx.aggregator, call.fold) if how is not None else None
    if mean is None:
        return False
    grid = call.ctx.compression.clip_range is not None
    if not grid and relay_plan_applies(call.ctx, mean, how,
                                       [w.key for w in call.work]) is not None:
        return False  # relays fold whole contributions: the flat round (with a grid, they
        # add the workers' integer sums: _GridBatched)
    plain = {k: {f: v for f, v in r.items() if f not in ("compress", "local")}
             for k, r in call.requests.items()}
    return batch_applies(mean, how, plain, call.state, len(call.ctx.live))


def play_compressed_batched(call: Any) -> Folded:
    """The round :func:`compressed_batch_applies` said is batched, played; its ``Folded``."""
    how = relay_weight(call.weight, by_examples)
    mean = exact_mean(call.ctx.aggregator, call.fold)
    assert how is not None and mean is not None and call.unpack is not None
    result, served, not_served, replies, failed = fold_compressed_batched(
        call.ctx, call.requests, call.state, call.unpack, call.compressed[1], call.weight, how,
        call.label, signature(call.reference), window=call.window, name=mean.name,
        send_state=call.send_state, on_stale=call.on_stale)
    attacked = tuple(sorted(k for k in served if replies.get(k, {}).get("attacked")))
    return Folded(result, served, not_served, replies, attacked=attacked, failed=failed)


def flat_payload_fold(call: Any) -> PayloadFold | None:
    """The linear fold a flat compressed round (a :class:`~meshkit.train._rounds.engine.RoundCall`
    no batched path took) sums its payloads into, a chunk at a time (module docstring,
    "flat"); None when each contribution is decoded whole: a rule that is not an exact
    weighted mean (a robust rule sees individual updates), a given fold, a simulated
    attack (it poisons decoded contributions), a mean that lets NaN through
    (``allow_nonfinite``) or asks for the float fold's arithmetic (``accumulate =
    "float64"``), or an unweighted mean over weights that may differ (it must refuse them)."""
    if call.compressed is None or call.given is not None or call.attack is not None \
            or call.state is None or call.reference is None:
        return None
    mean = exact_mean(call.ctx.aggregator, call.fold)
    if mean is None or mean.count or mean.allow_nonfinite or mean.wide:
        return None
    if not mean.weighted and relay_weight(call.weight, by_examples) != "once":
        return None
    store, unpack = call.compressed[1], call.compressed[2]
    # FedBN's own keys are kept per client, never folded: the sum's model lacks them.
    own = frozenset(k for k in (store.keys if store is not None else ()) if not is_residual(k))
    reference = {k: v for k, v in call.state.items() if k not in own}
    summed = CompressedSum(unpack.plan.compressor, reference,
                           raw=[k for k in unpack.raw if k not in own], name=mean.name,
                           residuals=unpack.residuals)
    expected = signature(call.reference)
    whole = {k: expected[k] for k in expected if k not in set(summed.keys)}
    return PayloadFold(summed, own, store, whole)


class PayloadFold:
    """A flat compressed round's linear fold (module docstring, "flat"): each pulled payload
    summed into one :class:`~meshkit.compression.CompressedSum`, a chunk at a time, never
    decoded whole; its client's own keys (FedBN) and residuals (error feedback) kept in the
    client-local store once it is folded, so a refused payload changes nothing."""

    def __init__(self, summed: CompressedSum, own: frozenset[str], store: ClientLocal | None,
                 whole: Signature) -> None:
        self.summed, self.own, self.store = summed, own, store
        #: What the keys sent whole (and the client's own keys) must look like.
        self.whole = whole

    @property
    def count(self) -> int:
        return self.summed.count

    def check(self, payload: Mapping[str, Any], what: str) -> None:
        """A ProtocolError unless ``payload`` fits the round's model: its keys sent whole
        (and its own keys) as the model's, each compressed key's fields within the
        compressor's bounds. Nothing is decoded."""
        check_contribution({k: payload.get(k) for k in self.whole}, self.whole, what,
                           finite=False)
        self.summed.check({k: v for k, v in payload.items() if k not in self.own}, what=what)

    def add(self, key: int, payload: Mapping[str, Any], weight: float, *, source: str) -> None:
        """Fold ``payload`` (client ``key``'s, checked by :meth:`check`) with ``weight``: a
        ProtocolError or AggregationError leaves the sum and the store as they were."""
        rest = {k: v for k, v in payload.items() if k not in self.own}
        residuals = self.summed.add(rest, weight, source=source)
        if self.store is not None:
            self.store.keep(key, {**{k: payload[k] for k in self.own}, **residuals})

    def result(self) -> dict[str, Any]:
        return self.summed.result()


def batch_size_bound(plan: CompressionPlan, state: Mapping[str, Any], raw: Sequence[str],
                     window: int) -> int:
    """The most fits a compressed batch carries: its payloads' most bytes (the compressor's
    ``bounds``, the keys sent whole, the residuals) within ``window`` whole models, or
    :data:`BATCH_BYTES` when that is more (a small model's batch is cut as the uncompressed
    batched round's is)."""
    keys = compressed_keys(state, raw)
    residual = 4 if plan.residuals_travel else 0
    payload = sum(np.dtype(dtype).itemsize * int(most)
                  for k in keys
                  for dtype, most in plan.compressor.bounds(int(state[k].size)).values())
    payload += sum(residual * int(state[k].size) for k in keys)
    payload += sum(int(v.nbytes) for k, v in state.items()
                   if k not in set(keys) and isinstance(v, np.ndarray))
    whole = sum(int(v.nbytes) for v in state.values() if isinstance(v, np.ndarray))
    return max(1, max(window * whole, BATCH_BYTES) // max(1, payload))


def fold_compressed_batched(ctx: StrategyContext, requests: Mapping[int, Mapping[str, Any]],
                            state: Mapping[str, Any], unpack: Unpacker, store: ClientLocal | None,
                            weight: Callable[[Mapping[str, Any]], float], how: str, label: str,
                            expected: Signature, *, window: int, name: str,
                            send_state: Callable[[int], Mapping[str, Any]] | None = None,
                            on_stale: Callable[[int], None] | None = None) -> tuple[
                                dict[str, Any] | None, dict[int, int], dict[int, str],
                                dict[int, Mapping[str, Any]], dict[int, str]]:
    """Serve ``requests`` (key -> compressed fit request) in batches and fold each payload
    into one :class:`CompressedSum` (module docstring); what :func:`.batched.fold_batched`
    gives back."""
    plan = unpack.plan
    if plan.clip_range is not None:
        # One integer sum a batch, whatever its size: the batch is cut as the uncompressed
        # batched round's.
        grid = CodeSum(plan.compressor, state, raw=unpack.raw, clip_range=plan.clip_range,
                       name=name)
        batched: _Batched = _GridBatched(
            ctx, dict(requests), state, how, label,
            {k: expected[k] for k in grid.whole_keys if k in expected}, grid, weight)
    else:
        fold = CompressedSum(plan.compressor, state, raw=unpack.raw, name=name,
                             residuals=unpack.residuals)
        whole = {k: expected[k] for k in fold.whole_keys if k in expected}
        batched = _CompressedBatched(ctx, dict(requests), state, how, label, whole, fold,
                                     store, weight)
        batched.max_size = min(batched.max_size,
                               batch_size_bound(plan, state, unpack.raw, window))
    batched.state_request, batched.on_stale = send_state, on_stale
    return batched.play()


def batch_fits(requests: Mapping[int, Mapping[str, Any]],
               batch: Sequence[int]) -> list[dict[str, Any]]:
    """A compressed ``fit_batch``'s fits: each client's request and its key, without what the
    batch carries once (``op``, ``compress``) or beside its fits (``local``: residuals)."""
    return [{**{k: v for k, v in requests[key].items()
                if k not in ("op", "compress", "local")}, "key": key} for key in batch]


class _CompressedBatched(_Batched):
    """The batched round (:mod:`.batched`) whose batches answer with each fit's compressed
    payload, folded at the coordinator as it arrives (module docstring)."""

    name = "the compressed batched round"

    def __init__(self, ctx: StrategyContext, requests: dict[int, Mapping[str, Any]],
                 state: Mapping[str, Any], how: str, label: str, whole: Signature,
                 fold: CompressedSum | CodeSum, store: ClientLocal | None,
                 weight: Callable[[Mapping[str, Any]], float]) -> None:
        super().__init__(ctx, requests, state, how, label, whole, 0, fold.name, None)
        self.fold, self.store, self.weight = fold, store, weight
        first = next(iter(requests.values()), {})
        self.compress = first.get("compress")

    def result(self) -> dict[str, Any]:
        return self.fold.result()

    def hand_out(self, rank: int, busy: set[int]) -> bool:
        batch = self.next_unit(rank, busy)
        if batch is None:
            return False
        fits = batch_fits(self.requests, batch)
        # No weight, no fraction_bits: the worker folds nothing (the coordinator weighs).
        request = {"op": "fit_batch", "fits": fits, "label": self.label,
                   "compress": self.compress}
        locals_ = {f"{key}/{name}": value for key in batch
                   for name, value in (self.requests[key].get("local") or {}).items()}
        if locals_:  # the clients' residuals (error feedback)
            request["locals"] = locals_
        timeout = None if self.ctx.timeout is None else self.ctx.timeout * len(batch)
        self.send(rank, "fit_batch", batch, request, timeout)
        return True

    def dispatched(self, busy: set[int]) -> None:
        """Nothing to pull: every payload came with its batch's answer."""

    def answered(self, rank: int, kind: str, batch: list[int] | None,
                 payload: Mapping[str, Any]) -> None:
        assert batch is not None  # only fit_batch is asked
        try:
            payloads = by_key(payload["payloads"])
            if not set(payloads) <= set(batch):
                extra = sorted(set(payloads) - set(batch))[:4]
                raise ProtocolError(f"its payloads name fits {extra} it was not asked for")
        except ProtocolError as exc:
            self.failed(rank, kind, batch, None, protocol_reason(exc))
            return
        for i, result in enumerate(payload["results"]):
            key = int(result["key"])
            self.replies[key] = small_reply(int(result["examples"]), result)
            what = f"rank {rank}'s result for {self.label} {key}"
            contribution = payloads.pop(key, {})  # held no longer than its turn
            try:
                check_contribution({k: contribution.get(k) for k in self.expected},
                                   self.expected, what, finite=False)
                assert isinstance(self.fold, CompressedSum)
                residuals = self.fold.add(contribution, self.weight(self.replies[key]),
                                          source=f"{self.label} {key} (rank {rank})")
            except (ProtocolError, AggregationError) as exc:
                reason = (protocol_reason(exc) if isinstance(exc, ProtocolError)
                          else f"refused by the fold: {exc}")
                # Its sender's (or, on a second rank, its client's); the rest of the batch
                # is served again, what was folded before it stays folded.
                self.failed(rank, kind, batch[i:], key, reason)
                return
            del contribution
            if self.store is not None and residuals:
                self.store.keep(key, residuals)
            self.served[key] = rank

    def client_dropped(self, rank: int, kind: str, batch: list[int] | None, key: int) -> None:
        """``key`` failed on two ranks: not served again; the rest of its batch that was not
        folded is (the rank serves on: it holds no partial)."""
        self.not_served[key] = self.failures.clients[key]
        self.replies.pop(key, None)
        again = [k for k in batch or [] if k != key and k not in self.served]
        for k in again:
            self.replies.pop(k, None)
        if again:
            self.respare(again)



class _GridBatched(_Batched):
    """The compressed batched round with ``[compression] clip_range``: each worker adds its
    batches' clients' codes on the shared grid into one exact integer sum
    (:class:`~meshkit.compression.CodeSum`), handed over with ``take_partial`` as the
    batched round's partial is, and merged into the coordinator's -- the bits of adding
    each client's codes here (:mod:`meshkit.compression._grid`)."""

    name = "the compressed batched round (one grid sum a worker)"

    def __init__(self, ctx: StrategyContext, requests: dict[int, Mapping[str, Any]],
                 state: Mapping[str, Any], how: str, label: str, whole: Signature,
                 grid: CodeSum, weight: Callable[[Mapping[str, Any]], float]) -> None:
        super().__init__(ctx, requests, state, how, label, whole, 0, grid.name, None)
        self.grid, self.weight = grid, weight
        first = next(iter(requests.values()), {})
        self.compress = {**first.get("compress", {}), "clip_range": grid.clip_range}
        #: The ranks behind each host relay: their sums are added by the relay
        #: (``grid_sum``, :mod:`meshkit.train._relay.grid`), not pulled one by one.
        groups = relay_groups(ctx)
        self.relays = {} if groups is None else groups.relays
        self.behind = {r: name for name, ranks in self.relays.items() for r in ranks}

    def run(self, keys: int) -> None:
        """The scheduler's round, then the relays' sums; a rank lost on the way has its
        clients served again, and its relay's sum pulled again (bounded: each pass sums
        every relay or loses a rank)."""
        for _ in range(len(self.behind) + 2):
            super().run(keys)
            pending = {name: [r for r in ranks if self.folded.get(r)]
                       for name, ranks in self.relays.items()}
            pending = {name: ranks for name, ranks in pending.items() if ranks}
            if not pending:
                return
            self._pull_relays(pending)
        raise MeshError(f"{self.name}: the relays' sums were not settled after "
                        f"{len(self.behind) + 2} passes")

    def dispatched(self, busy: set[int]) -> None:
        """Every batch answered: pull the direct workers' sums, one at a time (a relay's
        ranks' are the relay's to add, :meth:`run`)."""
        planned = self.spare or any(self.plan.values())
        working = any(kind != "take_partial" for _, kind, _ in self.busy.values())
        if not planned and not working and self.taking is None:
            for rank in sorted(self.folded):
                if self.folded[rank] and rank not in busy and rank not in self.behind:
                    self.taking = rank
                    self.send(rank, "take_partial", None, {"op": "take_partial"},
                              self.ctx.timeout)
                    break

    def _pull_relays(self, pending: Mapping[str, list[int]]) -> None:
        """One ``grid_sum`` to each relay in ``pending`` (name -> its ranks holding sums),
        each answer merged or its ranks lost."""
        budget = None if self.ctx.timeout is None else self.ctx.timeout * 2
        tickets = {self.ctx.pool.send_relay(name, grid_sum_request(ranks, self.ctx.timeout),
                                            budget): (name, ranks)
                   for name, ranks in pending.items()}
        for _ in range(len(tickets)):
            reply = self.ctx.pool.receive()
            assert reply is not None  # blocking: a reply or a failed ticket
            name, ranks = tickets[reply.seq]
            if reply.payload is None:
                self._drop(ranks, f"host relay {name!r} lost: {reply.error or 'lost'}")
                continue
            try:
                summed, wire, lost = parse_grid_sum_answer(reply.payload, ranks)
                if reply.payload.get("error"):
                    raise ProtocolError(str(reply.payload["error"]))
            except ProtocolError as exc:
                self._drop(ranks, protocol_reason(ProtocolError(
                    f"host relay {name!r}'s grid sum: {exc}")), dead=True)
                continue
            for rank, why in lost:
                self._drop([rank], f"host relay {name!r}: {why}",
                           dead=not why.startswith("failed: "))
            if wire is None:
                continue
            keys = [k for r in summed for k in self.folded.get(r, [])]
            source = f"host relay {name!r}'s grid sum of {len(keys)} {self.label}s"
            try:
                mass = sum(int(self.weight(self.replies[k])) for k in keys)
                if wire.get("mass") != mass or wire.get("count") != len(keys):
                    raise ProtocolError(f"{source} claims {wire.get('count')} contributions "
                                        f"weighing {wire.get('mass')}; its ranks summed "
                                        f"{len(keys)} weighing {mass}")
                self.grid.merge(wire, source=source, whole=self.expected)
            except ProtocolError as exc:
                self._drop(summed, protocol_reason(exc), dead=True)
                continue
            for rank in summed:
                for key in self.folded.pop(rank, []):
                    self.served[key] = rank

    def _drop(self, ranks: Sequence[int], reason: str, *, dead: bool = False) -> None:
        """``ranks`` lost for the round (declared dead: a protocol breach, or lost); the
        clients their sums held are served again."""
        for rank in ranks:
            if not self.failures.accept:
                raise WorkerError(rank, reason)
            if dead or rank not in self.ctx.dead:
                if dead:
                    self.ctx.pool.declare_dead(rank, reason)
                else:
                    self.failures.rank_failed(rank, reason)
            self.lose(rank, "take_partial", None, reason)

    def result(self) -> dict[str, Any]:
        return self.grid.result()

    def hand_out(self, rank: int, busy: set[int]) -> bool:
        batch = self.next_unit(rank, busy)
        if batch is None:
            return False
        fits = batch_fits(self.requests, batch)
        request = {"op": "fit_batch", "fits": fits, "label": self.label, "weight": self.how,
                   "compress": self.compress}
        timeout = None if self.ctx.timeout is None else self.ctx.timeout * len(batch)
        self.send(rank, "fit_batch", batch, request, timeout)
        return True

    def answered(self, rank: int, kind: str, batch: list[int] | None,
                 payload: Mapping[str, Any]) -> None:
        if kind == "fit_batch":
            super().answered(rank, kind, batch, payload)
            return
        # take_partial: the worker's one sum of every batch it answered
        self.taking = None
        keys = self.folded.get(rank, [])
        source = f"rank {rank}'s grid sum of {len(keys)} {self.label}s"
        wire = payload["partial"]
        try:
            mass = sum(int(self.weight(self.replies[k])) for k in keys)
            if wire.get("mass") != mass or wire.get("count") != len(keys):
                raise ProtocolError(f"{source} claims {wire.get('count')} contributions "
                                    f"weighing {wire.get('mass')}; it summed {len(keys)} "
                                    f"weighing {mass}")
            self.grid.merge(wire, source=source, whole=self.expected)
        except ProtocolError as exc:
            self._partial_failed(rank, kind, exc)  # a sum is no client's: as a partial
            return
        for key in self.folded.pop(rank):
            self.served[key] = rank
