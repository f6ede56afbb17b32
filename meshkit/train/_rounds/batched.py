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

The round plays on the scheduler the flat round shares (:mod:`.scheduler`:
requests in flight, who serves next, what a lost worker or a member's
failure costs); :class:`_Batched` here supplies its batches, the partial
pulls and what a partial merges into.
"""

from __future__ import annotations

import collections
import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from meshkit.aggregation import DEFAULT_FRACTION_BITS, FixedPartial, FixedPointSum, MeanFold
from meshkit.errors import AggregationError, ProtocolError, WorkerError
from meshkit.privacy import ClippedSum, one_bit
from meshkit.train._messages import Signature
from meshkit.train._pool import protocol_reason
from meshkit.train._rounds.scheduler import Scheduler, small_reply
from meshkit.train._strategy import StrategyContext

__all__ = ["batch_applies", "fold_batched", "BATCHES_PER_WORKER", "MIN_BATCH",
           "MAX_BATCH", "BATCH_FIELDS"]

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
                 name: str = "fedavg", private: ClippedSum | None = None,
                 send_state: Callable[[int], Mapping[str, Any]] | None = None) -> BatchFolded:
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
    batched = _Batched(ctx, dict(requests), state, how, label, expected, fraction_bits,
                       name, private)
    batched.state_request = send_state
    return batched.play()


class _Batched(Scheduler[list[int]]):
    """One batched round on the scheduler (:mod:`.scheduler`): its unit is a batch of keys,
    an answer folds into its worker's partial, merged when every batch is answered."""

    name = "the batched round"

    def __init__(self, ctx: StrategyContext, requests: dict[int, Mapping[str, Any]],
                 state: Mapping[str, Any], how: str, label: str, expected: Signature,
                 bits: int, name: str, private: ClippedSum | None) -> None:
        super().__init__(ctx, state, label)
        self.requests, self.how, self.expected, self.bits = requests, how, expected, bits
        self.total = FixedPointSum(fraction_bits=bits, name=name)
        self.private = private
        self.size = 1
        #: The most fits a batch carries (a path may bound it lower).
        self.max_size = MAX_BATCH
        #: Keys folded into each worker's partial and not merged yet.
        self.folded: dict[int, list[int]] = {}
        self.taking: int | None = None
        #: Keys of a batch whose rank was lost while fitting it (a stall, a crash): each
        #: is served again alone, so a client that stalls every rank is found by name.
        self.singles: set[int] = set()

    def play_round(self) -> BatchFolded:
        keys = self.quarantine(sorted(self.requests))
        for key in self.not_served:
            del self.requests[key]
        workers = self.ctx.live[:len(keys)]
        per_worker = math.ceil(len(keys) / max(1, len(workers)))
        self.size = max(1, min(self.max_size, per_worker, max(MIN_BATCH, math.ceil(
            len(keys) / max(1, len(workers) * BATCHES_PER_WORKER)))))
        self.plan_round_robin(self._batches(keys), workers)
        for rank in workers:
            self.send_state(rank)
        self.run(len(keys))
        left = [*self.spare, *(b for batches in self.plan.values() for b in batches)]
        if left:
            why = self.no_worker_left()
            for batch in left:
                for key in batch:
                    self.not_served[key] = why
        result = self.result() if self.served else None
        order = sorted(self.served)
        self.finish()
        return (result, {k: self.served[k] for k in order}, dict(sorted(self.not_served.items())),
                {k: self.replies[k] for k in order}, dict(self.failures.ranks))

    def result(self) -> dict[str, Any]:
        """The round's result, once every batch was answered (and something was served)."""
        return self.total.result() if self.private is None else self.private.result()

    def _batches(self, keys: Sequence[int]) -> list[list[int]]:
        return [list(keys[i:i + self.size]) for i in range(0, len(keys), self.size)]

    # -- what the scheduler asks -----------------------------------------------------------

    def hand_out(self, rank: int, busy: set[int]) -> bool:
        batch = self.next_unit(rank, busy)
        if batch is None:
            return False
        fits = [{**{k: v for k, v in self.requests[key].items() if k != "op"}, "key": key}
                for key in batch]
        # One request runs every fit of the batch: its timeout is theirs together.
        timeout = None if self.ctx.timeout is None else self.ctx.timeout * len(batch)
        request = {"op": "fit_batch", "fits": fits, "weight": self.how,
                   "fraction_bits": self.bits, "label": self.label}
        if self.private is not None:
            request["dp_clip"] = self.private.clip_norm
        self.send(rank, "fit_batch", batch, request, timeout)
        return True

    def dispatched(self, busy: set[int]) -> None:
        planned = self.spare or any(self.plan.values())
        working = any(kind != "take_partial" for _, kind, _ in self.busy.values())
        if not planned and not working and self.taking is None:
            # Every batch answered: pull the partials, one worker at a time.
            for rank in sorted(self.folded):
                if self.folded[rank] and rank not in busy:
                    self.taking = rank
                    self.send(rank, "take_partial", None, {"op": "take_partial"},
                              self.ctx.timeout)
                    break

    def blamed(self, kind: str, batch: list[int] | None,
               payload: Mapping[str, Any]) -> int | None:
        key = payload.get("key")  # a fit_batch error names the fit that failed
        return key if batch is not None and key in batch else None

    def answered(self, rank: int, kind: str, batch: list[int] | None,
                 payload: Mapping[str, Any]) -> None:
        if kind == "fit_batch":
            assert batch is not None
            for result in payload["results"]:
                self.replies[int(result["key"])] = small_reply(int(result["examples"]), result)
            self.folded.setdefault(rank, []).extend(batch)
            return
        # take_partial
        self.taking = None
        keys = self.folded.get(rank, [])
        try:
            partial = self._checked(rank, payload["partial"], keys)
        except ProtocolError as exc:
            self._partial_failed(rank, kind, exc)
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

    def _partial_failed(self, rank: int, kind: str, exc: ProtocolError) -> None:
        """``rank``'s partial failed its check: its sender's fault alone (a partial is no
        client's), so the rank goes and its keys are served again (module docstring, step 5);
        with ``accept_failures = false`` the run stops."""
        reason = protocol_reason(exc)
        if not self.failures.accept:
            raise WorkerError(rank, reason) from None
        self.ctx.pool.declare_dead(rank, reason)
        self.lose(rank, kind, None, self.ctx.pool.dead.get(rank, reason))

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

    def client_dropped(self, rank: int, kind: str, batch: list[int] | None, key: int) -> None:
        """The client's failure, not the rank's (module docstring, step 6): the rank starts its
        partial afresh (set_state discards it) and serves on; what it had folded is served
        again (the fits before the failed one are in its partial)."""
        self.not_served[key] = self.failures.clients[key]
        self.replies.pop(key, None)
        again = sorted({*self.folded.pop(rank, []), *(k for k in batch or [] if k != key)})
        for k in again:
            self.replies.pop(k, None)
        if again:
            self.spare = collections.deque(self._batches(sorted(
                {*again, *(k for b in self.spare for k in b)})))
        self.ready.discard(rank)
        self.send_state(rank)

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

    def requeue(self, rank: int, kind: str, batch: list[int] | None, reason: str) -> list[int]:
        """Every key in ``rank``'s partial, in its batch, or planned for it (its partial is
        lost: module docstring, steps 4 and 6)."""
        if kind == "take_partial":
            self.taking = None
        if kind == "fit_batch" and batch and rank not in self.failures.ranks:
            batch = self._stalled(rank, batch, reason)
        return sorted({*self.folded.pop(rank, []), *(batch or []),
                       *(k for b in self.plan.pop(rank, ()) for k in b)})

    def respare(self, again: list[int]) -> None:
        """Spare batches again, a key lost while fitting alone in a batch of its own."""
        spare = sorted({*again, *(k for b in self.spare for k in b)})
        self.spare = collections.deque(
            [[k] for k in spare if k in self.singles]
            + self._batches([k for k in spare if k not in self.singles]))
