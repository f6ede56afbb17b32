"""The flat round: one contribution at a time, pulled in key order within a window.

Rule: every flat round's requests, pulls and folds are decided here, on the
scheduler the batched round shares (:mod:`.scheduler`); the steps it follows
are :mod:`.engine`'s module docstring's (1--7), and which rounds play flat is
:data:`.engine.ROUND_PATHS`'. :class:`FlatRound` supplies the scheduler its
requests and what a pulled contribution folds into; :class:`PieceFlatRound`
pulls a large model's contributions piece by piece (:mod:`.pieces`).
"""

from __future__ import annotations

import collections
import logging
import math
import time
from typing import Any, Callable, Mapping

import numpy as np

from meshkit.aggregation import ContributionOutOfRange
from meshkit.errors import AggregationError, ProtocolError
from meshkit.train._failures import DivergedFit
from meshkit.train._local_keys import ClientLocal
from meshkit.train._messages import Signature, check_contribution
from meshkit.train._pool import protocol_reason
from meshkit.train._rounds.compressed import PayloadFold, Unpacker
from meshkit.train._rounds.pieces import PieceRound
from meshkit.train._rounds.scheduler import Scheduler, small_reply
from meshkit.train._rounds.work import HOLD, INLINE_BYTES, Folded
from meshkit.train._strategy import StrategyContext

__all__ = ["FlatRound", "PieceFlatRound", "inline_reach", "result_bytes"]

log = logging.getLogger(__name__)


def inline_reach(expected: Signature | None, unpack: Unpacker | None, budget: int) -> int:
    """How many results beyond the window come back with their fit: as many of the round's
    model (``expected``: a fit's result is the whole model, gradients at most that) as fit
    in ``budget`` bytes -- 0 for a model above it. 0 when the model is not known, and in
    a compressed round, whose decoded contributions also carry residuals the model's
    size does not bound."""
    if expected is None or unpack is not None or budget <= 0:
        return 0
    return budget // result_bytes(expected)


def result_bytes(expected: Signature) -> int:
    """The bytes :func:`inline_reach` counts a result of the model ``expected`` at: its
    arrays', and a little for each key (its name; a JSON value is not in the signature)."""
    # math.prod, not np.prod: the same integer for a shape tuple, without numpy's
    # per-call overhead (np.prod cost ~55 us a round for digits' four keys).
    size = sum(math.prod(shape) * np.dtype(dtype).itemsize
               for shape, dtype in filter(None, expected.values()))
    return size + _ENTRY_BYTES * len(expected)


#: What a model's entry is counted beside its array's bytes (its name, a JSON value).
_ENTRY_BYTES = 256

#: The reply field that carries a request's result when it is not kept, by op.
_RESULT_FIELD = {"fit": "state", "grads": "gradients"}


class FlatRound(Scheduler[int]):
    """One flat round on the scheduler (:mod:`.scheduler`), as the module docstring says:
    its unit is a key; an answer is held on its worker until pulled (``take``), and a
    pulled contribution folds in key order."""

    name = "the round engine"
    abandon_on = (DivergedFit, AggregationError)  # skipped, or played again

    def __init__(self, ctx: StrategyContext, requests: dict[int, Mapping[str, Any]],
                 state: Mapping[str, Any] | None, weight: Callable[[Mapping[str, Any]], float],
                 window: int, fold: Any, label: str, *, pinned: dict[int, int],
                 deadline: float | None, expected: Signature | None,
                 local: ClientLocal | None, scan: bool, unpack: Unpacker | None,
                 limit: Callable[[Any], float | None] | None = None,
                 state_request: Callable[[int], Mapping[str, Any]] | None = None,
                 on_stale: Callable[[int], None] | None = None) -> None:
        super().__init__(ctx, state, label)
        self.state_request, self.on_stale = state_request, on_stale
        self.requests, self.weight, self.window, self.fold = requests, weight, window, fold
        #: Keys beyond the window whose results come back with their fit too: as many
        #: of the round's model as fit in :data:`INLINE_BYTES` (:func:`inline_reach`).
        self.inline = inline_reach(expected, unpack, INLINE_BYTES if ctx.inline_bytes is None
                                   else ctx.inline_bytes)
        #: Keys only one worker may serve: key -> rank.
        self.pinned = pinned
        #: Pinned keys planned for each worker and not handed out yet (ascending).
        self.own: dict[int, collections.deque[int]] = {}
        #: Seconds the round may take before unanswered keys are late (None: no deadline).
        self.deadline = deadline
        #: Keys whose answer missed the deadline -> the rank that owed it (None: not handed out).
        self.late: dict[int, int | None] = {}
        #: Keys not folded yet and not given up on, in fold order.
        self.unfolded: list[int] = []
        #: Results waiting on each worker, by key.
        self.held: dict[int, set[int]] = {}
        #: Whole contributions pulled and waiting for their turn: key -> (rank, state).
        self.taken: dict[int, tuple[int, Mapping[str, Any]]] = {}
        #: What every pulled contribution must look like (the round's model), or None.
        self.expected = expected
        #: Where each client's local keys are kept before the rest is folded (FedBN).
        self.local = local
        #: Whether each pulled contribution is scanned for NaN/inf (module docstring, step 7).
        self.scan = scan
        #: A compressed round's decoder of pulled payloads (None: contributions come whole).
        self.unpack = unpack
        #: A compressed round's linear fold, which takes each payload as it came, chunk by
        #: chunk (None: a pulled payload is decoded whole first, ``unpack``).
        self.payloads = fold if isinstance(fold, PayloadFold) else None
        #: The largest |x| the fold accepts per dtype, scanned with NaN/inf (None: any finite).
        self.limit = limit
        #: Workers whose next work request carries the round's state (``set_state``
        #: inside the fit, step 1), and those whose request that carried it is in flight:
        #: rank -> its key.
        self.owed: set[int] = set()
        self.carrying: dict[int, int] = {}
        #: Whether the round's state goes with fits (a round of fits that carry none), decided
        #: once: not when a worker may answer its state request ``stale`` (``on_stale``,
        #: ``[compression] broadcast``): a delta goes on its own, before the fits, so a
        #: ``stale`` answer is re-sent whole before any fit starts from the wrong model.
        self.fits = state is not None and on_stale is None and all(
            r.get("op") == "fit" and "state" not in r for r in requests.values())

    def play_round(self) -> Folded:
        live = self.ctx.live  # asked once: each ask copies the pool's live list
        self.failures.needed = max(1, min(2, len(live)))
        self.ends = None if self.deadline is None else time.monotonic() + self.deadline
        self.unfolded = self.quarantine(sorted(self.requests))
        for key in self.unfolded:
            if key in self.pinned:
                rank = self.pinned[key]
                if rank in live:
                    self.own.setdefault(rank, collections.deque()).append(key)
                else:
                    self.not_served[key] = (f"its data is on rank {rank}, which is not a live "
                                            f"worker")
        self.unfolded = [k for k in self.unfolded if k not in self.not_served]
        free = [k for k in self.unfolded if k not in self.pinned]
        # Only as many workers as there is work: the rest get no state.
        workers = live if self.state is None else live[:len(free)]
        if self.pinned:
            workers = sorted({*workers, *self.own})
        self.plan_round_robin(free, workers)
        if self.state is None:
            self.ready = set(workers)  # replicas: each holds its own state
        elif self.fits:
            # Each worker's first fit carries the round's state: one message, not two.
            self.ready = set(workers)
            self.owed = set(workers)
            self.sent_state |= self.owed
        else:
            for rank in workers:
                self.send_state(rank)
                # A large state takes a while to write: start the workers that
                # already acknowledged theirs instead of waiting for the last.
                self.drain()
        self.run(len(self.requests))
        if self.unfolded:
            self._give_up()
        result = self.fold.result() if self.served else None
        self.finish()
        return Folded(result, dict(self.served), dict(self.not_served),
                      {k: self.replies[k] for k in self.served}, dict(self.late),
                      failed=dict(self.failures.ranks))

    # -- what the scheduler asks -------------------------------------------------------

    def hand_out(self, rank: int, busy: set[int]) -> bool:
        """A pull first (a result it holds within the window), else new work."""
        held = self.held.get(rank)
        if not held and not self.spare and not any(self.plan.values()) \
                and not any(self.own.values()):
            # Nothing to pull and no key left anywhere (choices would offer none): a worker
            # that answered the round's last keys is asked after every reply (issue 36).
            return False
        # The window's model-sized results, and as many small ones as fit in INLINE_BYTES.
        reach = self.unfolded[:self.window + self.inline]
        waiting = sorted(held & set(reach)) if held else []
        if held and waiting:
            key = waiting[0]
            held.discard(key)
            self.send(rank, "take", key, {"op": "take", "key": key}, self.ctx.timeout)
            return True
        nxt = None if self.expired else self.next_unit(rank, busy)
        if nxt is None:
            return False
        request = self.requests[nxt]
        if not (request.get("op") in _RESULT_FIELD and nxt in reach):
            request = {**request, "keep": nxt}
        # Within the pull window the result comes back at once (no hold, no take): it
        # would be pulled as soon as it answered anyway, and every result in flight or
        # pulled is a distinct key of the window, so the coordinator still holds at
        # most ``window`` of them, and ``inline`` small ones (INLINE_BYTES in all).
        if rank in self.owed:
            self.owed.discard(rank)
            self.carrying[rank] = nxt
            request = {**request, **self._state_fields(rank)}
        self.send(rank, "work", nxt, request, self.ctx.timeout)
        return True

    def _state_fields(self, rank: int) -> dict[str, Any]:
        """The fields that carry the round's state in ``rank``'s first fit: its
        ``set_state`` request's (``[strategy] trainable`` decides what it holds)."""
        held = ({"state": self.state} if self.state_request is None
                else self.state_request(rank))
        fields = {"state": held["state"], "set_state": True}
        if held.get("trainable") is not None:
            fields["trainable"] = held["trainable"]
        return fields

    def dispatched(self, busy: set[int]) -> None:
        if self.spare and self.state is not None and not self.expired:
            # A worker that had this round's state was lost and its work
            # waits: bring in a live worker that was not sent the state yet.
            fresh = [r for r in self.ctx.live if r not in self.sent_state]
            if fresh and len(self.sent_state - self.lost) < len(self.unfolded):
                if not self.fits:
                    self.send_state(fresh[0])
                    return
                # In a round of fits the state goes with its first fit, at once.
                self.sent_state.add(fresh[0])
                self.ready.add(fresh[0])
                self.owed.add(fresh[0])
                self.hand_out(fresh[0], busy)

    def choices(self, rank: int, busy: set[int]) -> list[tuple[collections.deque[int], int]]:
        """Its pinned keys before anything else; a worker holding :data:`HOLD` results
        takes on only the key the fold waits on."""
        options = super().choices(rank, busy)
        if self.own.get(rank):
            options.insert(0, (self.own[rank], 0))
        if len(self.held.get(rank, ())) >= HOLD:
            options = [(keys, i) for keys, i in options if keys[i] == self.unfolded[0]]
        return options

    def blamed(self, kind: str, key: int | None, payload: Mapping[str, Any]) -> int | None:
        return key  # a work or take request's client (None: set_state)

    def answered(self, rank: int, kind: str, key: int | None,
                 payload: Mapping[str, Any]) -> None:
        assert key is not None  # work and take requests carry their client's key
        self.carrying.pop(rank, None)
        if kind == "work":
            self.replies[key] = small_reply(payload.get("examples", 0), payload)
            if "kept" in payload:
                self.held.setdefault(rank, set()).add(key)
                return
            # Asked back at once (hand_out: within the window): pulled with its answer.
            field = _RESULT_FIELD[self.requests[key]["op"]]
            self._pulled(rank, key, payload[field])
            return
        self._pulled(rank, key, payload["state"])  # take

    def _pulled(self, rank: int, key: int, contribution: Mapping[str, Any]) -> None:
        """A pulled contribution (a take's, or a work reply's asked back at once): checked
        against the round's model, then folded when its turn comes."""
        kind = "take"  # failed as a pulled contribution, whichever request brought it
        if self.payloads is not None:
            # Checked against the round's model now, summed undecoded when its turn comes.
            try:
                self.payloads.check(contribution,
                                    f"rank {rank}'s result for {self.label} {key}")
            except ProtocolError as exc:
                self.failed(rank, kind, key, key, protocol_reason(exc))
                return
            self.taken[key] = (rank, contribution)
            self._advance()
            return
        residuals: dict[str, Any] = {}
        if self.unpack is not None and self.state is not None:
            try:
                contribution, residuals = self.unpack.decode(
                    contribution, self.state, f"rank {rank}'s result for {self.label} {key}")
            except ProtocolError as exc:
                self.failed(rank, kind, key, key, protocol_reason(exc))
                return
        if self.expected is not None:
            try:
                # A fit returns the whole model; gradients (no round state)
                # may leave out the model's JSON entries.
                check_contribution(contribution, self.expected,
                                   f"rank {rank}'s result for {self.label} {key}",
                                   subset=self.state is None, finite=self.scan,
                                   limit=self.limit)
            except ProtocolError as exc:
                # Its sender's (or its client's): the rank sits the round out and
                # its keys are served again (module docstring, step 7).
                self.failed(rank, kind, key, key, protocol_reason(exc))
                return
        if residuals:  # kept in the client-local store with the rest (_advance)
            contribution = {**contribution, **residuals}
        self.taken[key] = (rank, contribution)
        self._advance()

    def failed(self, rank: int, kind: str, unit: int | None, key: int | None,
               reason: str) -> None:
        if self.carrying.pop(rank, None) is not None:
            # An error reply to the fit that carried the round's state: the worker may
            # have refused it before holding the state, so its next request carries it.
            self.owed.add(rank)
        super().failed(rank, kind, unit, key, reason)

    def client_dropped(self, rank: int, kind: str, unit: int | None, key: int) -> None:
        self._drop_client(key)

    def requeue(self, rank: int, kind: str, key: int | None, reason: str) -> list[int]:
        """What it held, was planned or was doing (module docstring, steps 4 and 5)."""
        again = (self.held.pop(rank, set()) | set(self.plan.pop(rank, []))
                 | set(self.own.pop(rank, [])))
        self.owed.discard(rank)
        self.carrying.pop(rank, None)
        if kind in ("work", "take") and key is not None:
            if kind == "work" and rank not in self.failures.ranks \
                    and self.failures.client_failed(key, rank, f"lost while fitting it ({reason})"):
                # Lost while fitting it on a second rank (a hang, a crash): its own, and
                # not tried again in this run (each try costs a worker).
                self.ctx.stalled_clients[key] = self.failures.clients[key]
                self._drop_client(key)
            else:
                again.add(key)
        stuck = {k for k in again if k in self.pinned}
        for k in sorted(stuck):
            # Nobody else has its data: this round goes on without it.
            self.replies.pop(k, None)
            self.not_served[k] = f"its data is on rank {rank}, which was lost ({reason})"
        if stuck:
            self.unfolded = [k for k in self.unfolded if k not in stuck]
            again -= stuck
            self._advance()
        return sorted(again)

    def respare(self, again: list[int]) -> None:
        self.spare = collections.deque(sorted({*self.spare, *again}))

    # -- folding -------------------------------------------------------------------------
    def _advance(self) -> None:
        """Fold every pulled contribution whose turn has come, in key order."""
        while self.unfolded and self.unfolded[0] in self.taken:
            key = self.unfolded.pop(0)
            rank, contribution = self.taken.pop(key)
            if self.payloads is not None:
                self._fold_payload(key, rank, contribution)
                continue
            if self.local is not None:
                contribution = self.local.keep(key, contribution)
            source = f"{self.label} {key} (rank {rank})"
            keyed = getattr(self.fold, "add_keyed", None)
            try:
                if keyed is not None:  # an attacked round needs to know whose it is
                    keyed(key, contribution, self.weight(self.replies[key]), source=source)
                else:
                    self.fold.add(contribution, self.weight(self.replies[key]), source=source)
            except ContributionOutOfRange as exc:
                # A finite value no exact sum holds (1e308): its sender's, as a non-finite
                # one is, refused before the sum changed. Back in line, then failed as a
                # pulled contribution that does not fit is (module docstring, step 7).
                self.unfolded.insert(0, key)
                self.failed(rank, "take", key, key, f"out of range: {exc}")
                continue
            del contribution  # the fold holds it now, or has folded it
            self.served[key] = rank

    def _fold_payload(self, key: int, rank: int, payload: Mapping[str, Any]) -> None:
        """A compressed round's payload summed chunk by chunk (:class:`PayloadFold`); one the
        sum refuses (does not decode, NaN or inf, out of range) left it as it was, and is
        failed as a pulled contribution that does not fit (module docstring, step 7)."""
        source = f"{self.label} {key} (rank {rank})"
        assert self.payloads is not None
        try:
            self.payloads.add(key, payload, self.weight(self.replies[key]), source=source)
        except (ProtocolError, AggregationError) as exc:
            self.unfolded.insert(0, key)
            reason = (protocol_reason(exc) if isinstance(exc, ProtocolError)
                      else f"refused by the fold: {exc}")
            self.failed(rank, "take", key, key, reason)
            return
        self.served[key] = rank

    def _drop_client(self, key: int) -> None:
        """``key`` failed on two ranks: not served again this round."""
        self.not_served[key] = self.failures.clients[key]
        self.replies.pop(key, None)
        self.unfolded = [k for k in self.unfolded if k != key]
        for held in self.held.values():
            held.discard(key)
        if key in self.spare:
            self.spare.remove(key)
        self._advance()

    def expire(self) -> None:
        """The round deadline passed: whatever has not answered is late (module docstring)."""
        self.expired = True
        why = f"no answer within round_timeout = {self.deadline:g} s"
        for ticket, (rank, kind, key) in list(self.busy.items()):
            if kind == "take":
                continue  # answered in time; its result is still pulled
            del self.busy[ticket]
            self.ctx.pool.abandon(ticket)
            if kind == "state":
                self.ready.discard(rank)
            else:
                assert key is not None  # a work request carries its client's key
                self.late[key] = rank
        for plan in (self.plan, self.own):
            for rank, keys in plan.items():
                for key in keys:
                    self.late.setdefault(key, rank if rank in self.sent_state else None)
        self.own.clear()
        for key in self.spare:
            self.late.setdefault(key, None)
        self.plan.clear()
        self.spare.clear()
        for key, late_rank in sorted(self.late.items()):
            self.not_served[key] = (f"late: rank {late_rank} {why}" if late_rank is not None
                                    else f"late: not started within round_timeout = "
                                         f"{self.deadline:g} s")
        self.unfolded = [k for k in self.unfolded if k not in self.late]
        if self.late:
            log.warning("round deadline: %s %s late (%s); their workers serve on",
                        self.label + ("s" if len(self.late) > 1 else ""),
                        ", ".join(map(str, sorted(self.late))), why)
        self._advance()

    def _give_up(self) -> None:
        """No live worker is left: every key not pulled yet is not served."""
        why = self.no_worker_left()
        for key in self.unfolded:
            if key not in self.taken:
                self.not_served[key] = why
        # What was pulled before the last worker went is still folded, in order.
        self.unfolded = [k for k in self.unfolded if k in self.taken]
        self._advance()


class PieceFlatRound(PieceRound, FlatRound):
    """The flat round pulling contributions in pieces (:mod:`.pieces`)."""
