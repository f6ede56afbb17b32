"""The batched round: each worker fits its clients in batches and folds them itself, exactly.

Rule: when a round's fold is the strict mean (:class:`~meshkit.aggregation.MeanFold`,
the built-in ``fedavg`` and ``allreduce``) and nothing in it needs a single
client's contribution at the coordinator, the round engine plays it here: a
worker is a relay of one. Each worker folds the clients it fits into an
exact fixed-point partial sum (:class:`~meshkit.aggregation.FixedPointSum`)
and the coordinator merges one partial per worker. Integer sums do not
depend on order or split, so the result is the same bits whichever worker
served which client, and when a lost worker's clients are served again by
another (docs/strategies.md, "The round engine").

How a round goes (:func:`fold_batched`):

1. ``set_state`` once to each worker the round needs, as the flat engine.
2. The keys, in key order, are cut into batches of about
   ``keys / (workers * BATCHES_PER_WORKER)`` (at least :data:`MIN_BATCH`,
   at most :data:`MAX_BATCH` and a worker's share),
   planned round-robin over the workers: small enough that a slow worker
   does not hold up the round (a worker done with its plan takes over the
   last planned batch of a busy one) and that a lost worker costs little
   work again, large enough that a client costs no round trip of its own.
   Each ``fit_batch`` request carries its fits; the worker fits them one
   after another, folds each at once (one fit's result alive at a time)
   and answers with each fit's examples and metrics.
3. When every batch is answered, the coordinator pulls each worker's
   partial with ``take_partial``, one worker at a time (it holds one
   arriving partial beside its own sum: memory flat in workers), checks
   it and merges it.
4. A worker lost while it fits, or before its partial was merged, loses
   its partial: every key it had folded goes back to the front of the
   queue and is served by a live worker in the same round (a worker not
   sent the state yet is brought in when none is left). A key no live
   worker is left to serve is recorded as not served, with the reason.
5. A partial is checked like any message, then against what the
   coordinator knows: the round's model (keys, shapes, dtypes), the number
   of fits it folded and their mass (each fit's weight, from its small
   reply, rounded as the worker must have rounded it). One that does not
   fit is a protocol error for its rank alone, whose keys are served again.
6. A member's failure (:mod:`meshkit.train._failures`) -- an ``error``
   reply (its task raised, or its own fold refused a fit's result: NaN, out
   of range) -- drops that rank for the rest of the round (a partial that
   does not fit, step 5, is no client's: that rank is declared dead): its partial is lost, and every key it had folded or was
   fitting is served again by the others. A ``fit_batch`` error names the
   fit that failed (``key``); a client that fails on two ranks is the
   client's failure and is not served again this round. With ``[strategy]
   accept_failures = false`` any of them stops the run.

A private round (``[privacy]``: the round's fold is a
:class:`meshkit.privacy.ClippedSum`) is batched the same way: each worker
folds its clients' *clipped updates*, weight 1, into the same exact sum the
coordinator would (``fit_batch`` with ``dp_clip``), each fit's small result
carries its ``unclipped`` bit, and the coordinator merges each partial into
the round's fold, which clips it to n·S for n fits (a worker that did not clip
moves the sum no further than its n clients could) and adds the noise once.
The same bits as the flat round's (docs/privacy.md, "Folding per worker").

Not here (the flat engine, :mod:`meshkit.train._rounds.engine`, plays them): a
round deadline (a late batch would already be in its worker's sum), work
pinned to a rank, FedBN local keys (kept per client at the coordinator),
simulated attacks (poisoned one contribution at a time), any other
aggregator, ``allow_nonfinite``, ``accumulate = "float64"`` (asks for the
flat fold's arithmetic), an unweighted mean over unequal work,
data-parallel replicas (no round state), requests other than a plain
``fit``, and fewer than two keys a worker (batching would save no round
trip and double the bytes). :func:`batch_applies` says which.
"""

from __future__ import annotations

import collections
import logging
import math
from typing import Any, Mapping, Sequence

import numpy as np

from meshkit.aggregation import DEFAULT_FRACTION_BITS, FixedPartial, FixedPointSum, MeanFold
from meshkit.errors import AggregationError, MeshError, ProtocolError, WorkerError
from meshkit.privacy import ClippedSum, one_bit
from meshkit.train._failures import DivergedFit, RoundFailures, reply_failure, strike
from meshkit.train._messages import Signature
from meshkit.train._pool import protocol_reason
from meshkit.train._strategy import StrategyContext

__all__ = ["batch_applies", "fold_batched", "BATCHES_PER_WORKER", "MIN_BATCH",
           "MAX_BATCH", "BATCH_FIELDS"]

log = logging.getLogger(__name__)

#: Batches planned per worker: an idle worker takes the next, so a slow one
#: delays the round by at most about one batch.
BATCHES_PER_WORKER = 4
#: The fewest fits a batch carries when there are enough (each batch costs a round
#: trip, a process wake-up on busy cores), and the most.
MIN_BATCH = 16
MAX_BATCH = 64
#: The fit request fields a batch carries (anything else: the flat engine).
BATCH_FIELDS = frozenset({"op", "shard", "shards", "seed", "time_budget", "poison",
                          "clip_norm"})

#: What :func:`fold_batched` gives back: (result, served, not_served, replies, failed).
BatchFolded = tuple[dict[str, Any] | None, dict[int, int], dict[int, str],
                    dict[int, Mapping[str, Any]], dict[int, str]]


def batch_applies(fold: Any, how: str | None, requests: Mapping[int, Mapping[str, Any]],
                  state: Mapping[str, Any] | None, workers: int) -> bool:
    """Whether a round can be played batched (module docstring, "Not here") over ``workers``
    live workers: only when it pays, at two clients a worker or more (a worker's int64
    partial is two float32 models on the wire; with one client a worker, batching saves
    no round trip and doubles the bytes)."""
    if how is None or state is None or not requests or len(requests) < 2 * workers:
        return False
    if isinstance(fold, ClippedSum):  # a private round: every client counts once
        if how != "once" or fold.count:
            return False
    elif type(fold) is not MeanFold or fold.count or fold.allow_nonfinite or fold.wide:
        return False  # (wide: accumulate = "float64" asks for the flat fold's arithmetic)
    elif not fold.weighted and how != "once":
        return False  # allreduce must refuse unequal work; it sees each weight flat
    return all(r.get("op") == "fit" and set(r) <= BATCH_FIELDS for r in requests.values())


def fold_batched(ctx: StrategyContext, requests: Mapping[int, Mapping[str, Any]],
                 state: Mapping[str, Any], how: str, label: str, expected: Signature,
                 *, fraction_bits: int = DEFAULT_FRACTION_BITS,
                 name: str = "fedavg", private: ClippedSum | None = None) -> BatchFolded:
    """Serve ``requests`` (key -> fit request) batched; see the module docstring.

    ``how`` is each fit's weight (``"examples"`` or ``"once"``), ``expected``
    the round's model as every partial must match it, ``name`` the
    aggregator's name in refusals. ``private``: the private round's fold, into
    which each worker's partial sum of clipped updates is merged (its result is
    the round's).
    """
    if private is not None:
        fraction_bits = private.fraction_bits
        # A partial of updates: the model's float keys, summed from float64.
        expected = {k: (tuple(state[k].shape), np.dtype(np.float64)) for k in private.keys}
    return _Batched(ctx, dict(requests), state, how, label, expected, fraction_bits,
                    name, private).play()


class _Batched:
    """The state of one batched round while it is played."""

    def __init__(self, ctx: StrategyContext, requests: dict[int, Mapping[str, Any]],
                 state: Mapping[str, Any], how: str, label: str, expected: Signature,
                 bits: int, name: str, private: ClippedSum | None) -> None:
        self.ctx, self.requests, self.state, self.how = ctx, requests, state, how
        self.label, self.expected, self.bits = label, expected, bits
        self.total = FixedPointSum(fraction_bits=bits, name=name)
        self.private = private
        #: Batches planned for each worker and not handed out yet, in key order.
        self.plan: dict[int, collections.deque[list[int]]] = {}
        #: Batches whose worker was lost: any worker may serve them.
        self.spare: collections.deque[list[int]] = collections.deque()
        self.size = 1
        #: ticket -> (rank, kind, keys of the batch or None).
        self.busy: dict[int, tuple[int, str, list[int] | None]] = {}
        self.ready: set[int] = set()
        self.lost: set[int] = set()
        #: Keys folded into each worker's partial and not merged yet.
        self.folded: dict[int, list[int]] = {}
        self.taking: int | None = None
        self.replies: dict[int, Mapping[str, Any]] = {}
        self.served: dict[int, int] = {}
        self.not_served: dict[int, str] = {}
        self.failures = RoundFailures(accept=ctx.accept_failures)
        #: Keys of a batch whose rank was lost while fitting it (a stall, a crash): each
        #: is served again alone, so a client that stalls every rank is found by name.
        self.singles: set[int] = set()

    def play(self) -> BatchFolded:
        for key in [k for k in self.requests if k in self.ctx.stalled_clients]:
            # Each try would cost a worker (meshkit.train._failures).
            self.not_served[key] = f"quarantined: {self.ctx.stalled_clients[key]}"
            del self.requests[key]
        try:
            return self._play()
        except DivergedFit:
            # The round is abandoned (on_nonfinite = "skip-round" plays the next): the
            # replies still owed must not be taken for the next round's.
            for ticket in self.busy:
                self.ctx.pool.abandon(ticket)
            raise

    def _play(self) -> BatchFolded:
        keys = sorted(self.requests)
        workers = self.ctx.live[:len(keys)]
        per_worker = math.ceil(len(keys) / max(1, len(workers)))
        self.size = max(1, min(MAX_BATCH, per_worker, max(MIN_BATCH, math.ceil(
            len(keys) / max(1, len(workers) * BATCHES_PER_WORKER)))))
        batches = self._batches(keys)
        for i, batch in enumerate(batches):
            if workers:
                self.plan.setdefault(workers[i % len(workers)], collections.deque()).append(batch)
            else:
                self.spare.append(batch)
        for rank in workers:
            self._send_state(rank)
        # Bounded: each reply settles one request; a batch is handed out again
        # only after a worker was lost (at most once per worker).
        limit = 8 * (len(keys) + 1) * (len(self.ctx.workers) + 1)
        for _ in range(limit):
            self._dispatch()
            if not self.busy:
                break
            # Not kept in a local: a partial's arrays go as soon as it is merged.
            self._settle(self.ctx.pool.receive())
        else:  # pragma: no cover - a bug in the scheduling, never a hang
            raise MeshError(f"the batched round settled {limit} replies without finishing")
        left = [*self.spare, *(b for batches in self.plan.values() for b in batches)]
        if left:
            dead = "; ".join(f"rank {r}: {why}" for r, why in self.ctx.dead.items()) or "none"
            why = f"no live worker left to serve it (dead: {dead})"
            if self.failures.ranks:
                why += "; dropped for this round: " + "; ".join(
                    f"rank {r}: {w}" for r, w in sorted(self.failures.ranks.items()))
            for batch in left:
                for key in batch:
                    self.not_served[key] = why
        if not self.served:
            result = None
        else:
            result = self.total.result() if self.private is None else self.private.result()
        order = sorted(self.served)
        strike(self.ctx, self.failures)
        return (result, {k: self.served[k] for k in order}, dict(sorted(self.not_served.items())),
                {k: self.replies[k] for k in order}, dict(self.failures.ranks))

    # -- sending ---------------------------------------------------------------------------

    def _batches(self, keys: Sequence[int]) -> list[list[int]]:
        return [list(keys[i:i + self.size]) for i in range(0, len(keys), self.size)]

    def _next_batch(self, rank: int, busy: set[int]) -> list[int] | None:
        """What ``rank`` serves next: its own plan's, a lost worker's, or a busy worker's last
        (a worker that has not acknowledged the state yet keeps its plan)."""
        own = self.plan.get(rank)
        if own:
            return own.popleft()
        if self.spare:
            return self.spare.popleft()
        victims = [self.plan[r] for r in sorted(self.ready) if r != rank and r in busy
                   and self.plan.get(r)]
        return max(victims, key=len).pop() if victims else None

    def _send(self, rank: int, kind: str, keys: list[int] | None,
              request: Mapping[str, Any], timeout: float | None) -> None:
        self.busy[self.ctx.pool.send(rank, request, timeout)] = (rank, kind, keys)

    def _send_state(self, rank: int) -> None:
        self._send(rank, "state", None, {"op": "set_state", "state": self.state},
                   self.ctx.timeout)

    def _dispatch(self) -> None:
        busy = {rank for rank, _, _ in self.busy.values()}
        for rank in sorted(self.ready - busy):
            batch = self._next_batch(rank, busy)
            if batch is None:
                continue
            fits = [{**{k: v for k, v in self.requests[key].items() if k != "op"}, "key": key}
                    for key in batch]
            # One request runs every fit of the batch: its timeout is theirs together.
            timeout = None if self.ctx.timeout is None else self.ctx.timeout * len(batch)
            request = {"op": "fit_batch", "fits": fits, "weight": self.how,
                       "fraction_bits": self.bits, "label": self.label}
            if self.private is not None:
                request["dp_clip"] = self.private.clip_norm
            self._send(rank, "fit_batch", batch, request, timeout)
            busy.add(rank)
        planned = self.spare or any(self.plan.values())
        working = any(kind != "take_partial" for _, kind, _ in self.busy.values())
        if not planned and not working and self.taking is None:
            # Every batch answered: pull the partials, one worker at a time.
            for rank in sorted(self.folded):
                if self.folded[rank] and rank not in busy:
                    self.taking = rank
                    self._send(rank, "take_partial", None, {"op": "take_partial"},
                               self.ctx.timeout)
                    break

    # -- receiving -------------------------------------------------------------------------

    def _settle(self, reply: Any) -> None:
        assert reply is not None  # a blocking receive gives a reply or a failed ticket
        rank, kind, batch = self.busy.pop(reply.seq)
        if not reply.ok:
            if not self.failures.accept:
                raise WorkerError(rank, reply.error or "lost")
            self._lost(rank, kind, batch, reply.error or "lost")
            return
        payload = reply.payload
        failure = reply_failure(rank, payload, accept=self.failures.accept)
        if failure is not None:
            key = payload.get("key")
            self._failed(rank, kind, batch,
                         key if batch is not None and key in batch else None, failure)
            return
        if kind == "state":
            self.ready.add(rank)
        elif kind == "fit_batch":
            assert batch is not None
            for result in payload["results"]:
                small: dict[str, Any] = {"examples": int(result["examples"]),
                                         "metrics": dict(result.get("metrics") or {})}
                if result.get("attacked"):  # a node run with --attack says so
                    small["attacked"] = str(result["attacked"])
                self.replies[int(result["key"])] = small
            self.folded.setdefault(rank, []).extend(batch)
        else:  # take_partial
            self.taking = None
            keys = self.folded.get(rank, [])
            try:
                partial = self._checked(rank, payload["partial"], keys)
            except ProtocolError as exc:
                # Its sender's fault alone (a partial is no client's): the rank goes, its
                # keys are served again.
                reason = protocol_reason(exc)
                if not self.failures.accept:
                    raise WorkerError(rank, reason) from None
                self.ctx.pool.declare_dead(rank, reason)
                self._lost(rank, kind, None, self.ctx.pool.dead.get(rank, reason))
                return
            source = f"rank {rank} ({len(keys)} {self.label}s)"
            if self.private is None:
                self.total.merge(partial, source=source)
            else:
                # Each fit's bit from its small reply, one bit each (adaptive clipping).
                bits = sum(one_bit(self.replies[k]["metrics"].get("unclipped")) for k in keys)
                self.private.merge(partial, unclipped=bits, source=source)
            for key in self.folded.pop(rank):
                self.served[key] = rank

    def _checked(self, rank: int, wire: Mapping[str, Any], keys: list[int]) -> FixedPartial:
        """Rank ``rank``'s partial, if it is what folding ``keys`` must give; else ProtocolError."""
        what = f"rank {rank}'s partial sum of {len(keys)} {self.label}s"
        try:
            partial = FixedPartial.from_wire(wire, what=what, max_count=len(keys))
        except AggregationError as exc:
            raise ProtocolError(str(exc)) from None
        one = 2.0 ** self.bits
        mass = sum(round((float(self.replies[k]["examples"]) if self.how == "examples"
                          else 1.0) * one) for k in keys)
        if partial.fraction_bits != self.bits or partial.count != len(keys) \
                or partial.mass != mass:
            raise ProtocolError(f"{what} claims {partial.count} contributions of mass "
                                f"{partial.mass} in 2^-{partial.fraction_bits}; it folded "
                                f"{len(keys)} of mass {mass} in 2^-{self.bits}")
        mismatch = partial.matches(self.expected)
        if mismatch is not None:
            raise ProtocolError(f"{what} does not match the round's model: {mismatch}")
        return partial

    def _failed(self, rank: int, kind: str, batch: list[int] | None, key: int | None,
                reason: str) -> None:
        """A member failed (module docstring, step 6). Its partial is unusable either way
        (the fits before the failed one are in it): it sits out the round."""
        if key is not None and self.failures.client_failed(key, rank, reason):
            # The client's failure, not the rank's: the rank starts its partial afresh
            # (set_state discards it) and serves on; what it had folded is served again.
            self.not_served[key] = self.failures.clients[key]
            self.replies.pop(key, None)
            again = sorted({*self.folded.pop(rank, []), *(k for k in batch or [] if k != key)})
            for k in again:
                self.replies.pop(k, None)
            if again:
                self.spare = collections.deque(self._batches(sorted(
                    {*again, *(k for b in self.spare for k in b)})))
            self.ready.discard(rank)
            self._send_state(rank)
            return
        self.failures.rank_failed(rank, reason)
        self._lost(rank, kind, batch, reason)

    def _stalled(self, rank: int, batch: list[int], reason: str) -> list[int]:
        """``rank`` was lost while fitting ``batch``: which client did it is not known, so
        each is served again alone; one lost alone on a second rank is its own failure.
        The keys of ``batch`` still to serve."""
        why = f"lost while fitting it ({reason})"
        if len(batch) > 1:
            for key in batch:
                self.failures.tries.setdefault(key, {})[rank] = why
            self.singles.update(batch)
            return batch
        key = batch[0]
        if self.failures.client_failed(key, rank, why):
            self.not_served[key] = self.failures.clients[key]
            self.ctx.stalled_clients[key] = self.failures.clients[key]  # not tried again
            return []
        self.singles.add(key)
        return batch

    def _lost(self, rank: int, kind: str, batch: list[int] | None, reason: str) -> None:
        """A worker is gone: every key in its partial, or in its batch, is served again."""
        self.ready.discard(rank)
        self.lost.add(rank)
        if kind == "take_partial":
            self.taking = None
        if kind == "fit_batch" and batch and rank not in self.failures.ranks:
            batch = self._stalled(rank, batch, reason)
        again = sorted({*self.folded.pop(rank, []), *(batch or []),
                        *(k for b in self.plan.pop(rank, ()) for k in b)})
        for key in again:
            self.replies.pop(key, None)
        if again:
            spare = sorted({*again, *(k for b in self.spare for k in b)})
            self.spare = collections.deque(
                [[k] for k in spare if k in self.singles]
                + self._batches([k for k in spare if k not in self.singles]))
            log.warning("rank %d lost (%s); %s %s will be served by another worker", rank,
                        reason, self.label + ("s" if len(again) > 1 else ""),
                        ", ".join(map(str, again)))
