"""The star reduce service: rounds of weighted contributions, folded on rank 0.

Semantics (carried from the reference cluster controller, DESIGN §5):

* A round is opened by the coordinator calling ``group.reduce_round(...)``
  (:meth:`ReduceService.run_round`). Every worker that is alive when the
  round starts is expected to contribute exactly once, with
  ``group.all_reduce(state, weight)`` (:meth:`ReduceService.contribute`).
  The weight is the *realized work* behind the contribution (examples seen;
  1.0 for a plain mean).
* Contributions are folded **as they arrive** into ``aggregator.begin()``,
  so the coordinator holds one accumulator, not one copy per worker. The
  service takes the fold from the aggregator itself (the transport knows
  nothing of :mod:`meshkit.aggregation`); an aggregator with only
  ``aggregate()`` is refused with a message naming
  ``meshkit.aggregation.streaming(aggregator)``, which buffers the round. Only complete, authenticated frames
  reach the fold: the transport decodes a frame fully (and checks its MAC)
  before handing it over, so a frame cut off mid-way is never half-folded.
* The fold divides once, by the mass it actually accepted, so a rank that
  dies needs no divisor adjustment: the consensus is the weighted mean over
  the survivors.
* A worker that disconnects, stalls past the timeout (mid-frame: the
  transport's read timeout; not sending at all: the round's deadline), or
  fails authentication is declared dead in the group's ledger
  (``group.dead``, permanent) and its link is dropped. A contribution only
  enters the fold once its whole frame has arrived and authenticated, so a
  partial one is discarded; a rank that dies *after* its complete
  contribution was folded (while waiting for the scatter) stays in the
  consensus and is listed in both ``contributors`` and ``dead``, because a
  streaming fold cannot take a contribution back. The round completes with
  the survivors.
* When an outer optimizer is given, ``outer.step(global_state, consensus)``
  turns the consensus into the new global state *before* the scatter, so
  every worker adopts the stepped model.
* One state is scattered to every surviving contributor. A write that fails
  or stalls past the timeout declares that rank dead and the scatter goes on
  to the others (elastic scatter).
* Contributions the aggregator cannot combine (a missing key, a shape that
  disagrees, a negative weight, NaN) abort the round: the coordinator raises
  the :class:`~meshkit.AggregationError` and every waiting worker receives it
  too, so no one continues from a local value.
* When not a single contribution can be accepted (every worker dead), the
  round raises :class:`~meshkit.PeerLostError` quoting the dead ledger. That
  is how the service ends cleanly: it never scatters an invented consensus.
* Model frames may travel as bfloat16 (the transport's ``bf16_wire``
  option): the transport widens them back to float32 on receipt, so the fold
  and the outer optimizer accumulate in float32 or wider. ``kind="control"``
  traffic (counts, anything that must be exact) is never narrowed.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Callable, Mapping

import attrs

from meshkit.errors import AggregationError, MeshError, PeerLostError, WireError
from meshkit.transport._ledger import Ledger
from meshkit.transport._mailbox import Mailboxes
from meshkit.transport._message import Message, check_kind, check_state
from meshkit.transport._timeouts import deadline_after
from meshkit.transport.tags import TAG_REDUCE, TAG_SCATTER

__all__ = ["RoundResult", "ReduceService", "MIN_SCATTER_BYTES_PER_SECOND"]

log = logging.getLogger(__name__)

#: The slowest sustained rate a scatter write may run at. The transport's
#: stall timeout only catches a reader that makes *no* progress; one that
#: trickles a byte at a time would otherwise hold the whole round (and every
#: rank that behaves) for as long as it likes.
MIN_SCATTER_BYTES_PER_SECOND = 1 << 20


@attrs.frozen
class RoundResult:
    """What one reduce round did.

    ``consensus`` is the aggregator's result (weighted mean over the accepted
    contributions); ``state`` is what was scattered (``consensus`` stepped by
    the outer optimizer, or ``consensus`` itself). ``contributors`` and
    ``weights`` are the accepted contributions in arrival order (rank 0 first
    when the coordinator contributed). ``dead`` lists the ranks declared dead
    during this round, ``ledger`` the whole dead ledger after it.
    """

    round: int
    consensus: dict[str, Any]
    state: dict[str, Any]
    contributors: list[int]
    weights: list[float]
    dead: list[int]
    ledger: dict[int, str]

    @property
    def total_weight(self) -> float:
        """The accepted mass the fold divided by."""
        return float(sum(self.weights))


def _check_weight(weight: Any, who: str) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        try:
            weight = float(weight)  # numpy scalars
        except (TypeError, ValueError):
            raise AggregationError(
                f"{who}: the weight must be a number (the realized work, e.g. examples "
                f"seen), got {weight!r}") from None
    weight = float(weight)
    if not math.isfinite(weight) or weight < 0:
        raise AggregationError(
            f"{who}: the weight must be finite and >= 0 (the realized work, e.g. "
            f"examples seen), got {weight!r}")
    return weight


def _payload_bytes(state: Mapping[str, Any]) -> int:
    return sum(int(getattr(v, "nbytes", 0)) for v in state.values())


class ReduceService:
    """One rank's side of the reduce service, over its group's ledger, mailboxes and sends.

    ``send(message, timeout)`` routes a kernel message (the group's own
    send, reserved tags allowed); ``declare_dead(rank, reason)`` is the
    group's; ``send_deadlines`` is the transport's :attr:`Links.send_deadlines`.
    """

    def __init__(self, ledger: Ledger, mailboxes: Mailboxes,
                 send: Callable[[Message, float | None], None],
                 declare_dead: Callable[[int, str], None], *, timeout: float,
                 send_deadlines: bool) -> None:
        self._ledger = ledger
        self._mailboxes = mailboxes
        self._send = send
        self._declare_dead = declare_dead
        self._timeout = timeout
        self._send_deadlines = send_deadlines
        self._round = 0

    @property
    def round(self) -> int:
        """How many reduce rounds this rank has started."""
        return self._round

    # -- worker side ----------------------------------------------------------

    def contribute(self, state: Mapping[str, Any], weight: float = 1.0,
                   timeout: float | None = None, *, kind: str = "model") -> dict[str, Any]:
        """Worker side of the reduce service (``group.all_reduce``).

        Sends the contribution to rank 0 and blocks for the round's scatter.
        ``timeout`` bounds the whole wait; by default twice the group timeout,
        because the coordinator may itself wait one timeout for the slowest rank
        before it can scatter.
        """
        rank = self._ledger.rank
        if self._ledger.is_coordinator:
            raise MeshError(
                "rank 0 runs the reduce service and cannot all_reduce into itself: call "
                "group.reduce_round(aggregator, ..., contribution=state, weight=w) instead")
        check_kind(kind)
        weight = _check_weight(weight, f"rank {rank}")
        check_state(state, "all_reduce state")
        round_no = self._round
        if timeout is None:
            timeout = 2 * self._timeout
        deadline = deadline_after(timeout, self._timeout)
        meta = {"round": round_no, "weight": weight}
        self._send(Message(rank, 0, TAG_REDUCE, state, meta, kind), timeout)
        # Counted once sent: a payload the wire refused (nothing sent) may be
        # corrected and retried in the same round.
        self._round += 1
        remaining = max(0.0, deadline - time.monotonic())
        message = self._mailboxes.take(TAG_SCATTER, {0}, remaining,
                                       what=f"the consensus of reduce round {round_no}")
        got = message.meta.get("round")
        if got != round_no:
            raise WireError(
                f"rank {rank}: expected the consensus of reduce round {round_no}, the "
                f"coordinator sent round {got!r}; this rank and the coordinator disagree on "
                f"the round count (a worker must call all_reduce once per round)")
        error = message.meta.get("error")
        if error is not None:
            if message.meta.get("reason") == "aggregation":
                raise AggregationError(f"the coordinator refused reduce round {round_no}: {error}")
            raise MeshError(f"the coordinator aborted reduce round {round_no}: {error}")
        return dict(message.payload)

    # -- coordinator side -----------------------------------------------------

    def run_round(self, aggregator: Any, outer: Any = None, global_state: Any = None,
                  timeout: float | None = None, *, contribution: Any = None,
                  weight: float = 1.0, kind: str = "model") -> RoundResult:
        """Coordinator side of the reduce service (``group.reduce_round``); see the module doc."""
        ledger = self._ledger
        if not ledger.is_coordinator:
            raise MeshError(
                f"rank {ledger.rank} is a worker: only the coordinator (rank 0) runs reduce "
                f"rounds; workers call group.all_reduce(state, weight)")
        check_kind(kind)
        if outer is not None and global_state is None:
            raise MeshError(
                "reduce_round: an outer optimizer needs the current global state to step "
                "from (pass global_state=...)")
        start = getattr(aggregator, "begin", None)
        if not callable(start):
            raise MeshError(
                f"reduce_round needs a streaming aggregator (one with begin(), which the "
                f"service folds each contribution into as it arrives), got {aggregator!r}; "
                f"build one with meshkit.plugins.create('aggregator', name), or wrap an "
                f"aggregator that only has aggregate() in "
                f"meshkit.aggregation.streaming(aggregator), which buffers the round "
                f"(O(workers x model) memory)")
        if timeout is None:
            timeout = self._timeout
        deadline = deadline_after(timeout, self._timeout)
        round_no = self._round
        self._round += 1
        fold = start()
        contributors: list[int] = []
        weights: list[float] = []

        pending = set(range(1, ledger.world_size)) - set(ledger.dead())
        expected = set(pending)

        try:
            # Inside the guard: a contribution of our own that is refused must
            # abort the round for the workers too, not leave them waiting.
            if contribution is not None:
                weight = _check_weight(weight, "rank 0 (coordinator)")
                check_state(contribution, "the coordinator's contribution")
                fold.add(contribution, weight, source="rank 0 (coordinator)")
                contributors.append(0)
                weights.append(weight)

            while True:
                message = self._mailboxes.take_first(TAG_REDUCE, pending, deadline)
                if message is None:
                    break
                src = message.src
                got_round = message.meta.get("round")
                if isinstance(got_round, int) and got_round < round_no:
                    # A late contribution to a round that was aborted: the worker
                    # already got the refusal; wait for this round's contribution.
                    continue
                pending.discard(src)
                if got_round != round_no:
                    self._declare_dead(src, (
                        f"sent a contribution for reduce round {got_round!r} while the "
                        f"coordinator was running round {round_no} (protocol violation)"))
                    continue
                try:
                    got_weight = _check_weight(message.meta.get("weight"), f"rank {src}")
                except AggregationError as exc:
                    self._declare_dead(src, f"protocol violation: {exc}")
                    continue
                fold.add(message.payload, got_weight, source=f"rank {src}")
                contributors.append(src)
                weights.append(got_weight)

            joined = ledger.joined()
            for rank in sorted(pending):
                if rank in joined:
                    why = (f"sent no contribution to reduce round {round_no} within "
                           f"{timeout:g} s (stalled, or stopped mid-frame)")
                else:
                    why = (f"had not joined the mesh by the end of reduce round {round_no} "
                           f"({timeout:g} s)")
                self._declare_dead(rank, why)

            if not contributors:
                raise PeerLostError(
                    f"reduce round {round_no}: no contribution could be accepted; every "
                    f"worker is dead ({ledger.describe()}). The reduce service has "
                    f"ended; nothing was scattered.")
            consensus = dict(fold.result())
            new_state = (dict(outer.step(global_state, consensus)) if outer is not None
                         else consensus)
        except AggregationError as exc:
            self._abort(round_no, expected, str(exc), "aggregation")
            raise
        except BaseException as exc:
            # Whatever went wrong here (an outer optimizer's bug, a closed group),
            # the workers must not wait out their timeout for a scatter that will
            # never come.
            self._abort(round_no, expected,
                        f"{type(exc).__name__} on the coordinator: {exc}", "internal")
            raise

        targets = [r for r in contributors if r != 0]
        failed = self._scatter(round_no, targets, new_state, kind)
        # Dead *in this round*: expected but not accepted, or unreachable for the
        # scatter. A worker that got its scatter and then left is not counted here
        # (the ledger shows it).
        lost = (expected - set(contributors)) | set(failed)
        return RoundResult(
            round=round_no, consensus=consensus, state=new_state, contributors=contributors,
            weights=weights, dead=sorted(lost), ledger=ledger.dead())

    def _scatter(self, round_no: int, targets: list[int], state: dict[str, Any],
                 kind: str) -> list[int]:
        """Send one state to every target in parallel; a failed write declares that rank dead.

        Each write has the transport's stall timeout, and the scatter as a whole
        a deadline of that timeout plus the payload's time at
        :data:`MIN_SCATTER_BYTES_PER_SECOND`: a rank still being written to then
        is declared dead (dropping its link ends the write) and the round goes on.
        """
        failed: set[int] = set()
        lock = threading.Lock()
        budget = self._timeout + _payload_bytes(state) / MIN_SCATTER_BYTES_PER_SECOND
        deadline = time.monotonic() + budget

        def send_one(rank: int) -> None:
            try:
                self._send(Message(0, rank, TAG_SCATTER, state, {"round": round_no}, kind,
                                   deadline=deadline), None)
            except (PeerLostError, WireError, OSError) as exc:
                with lock:
                    failed.add(rank)
                self._declare_dead(rank, f"the scatter of reduce round {round_no} failed: {exc}")

        if len(targets) == 1 and self._send_deadlines:
            # One rank to write to, and a transport that stops the write at the
            # deadline: no thread to start and join (a tenth of a 1 MiB round).
            send_one(targets[0])
            return sorted(failed)
        # Parallel writes: one wedged rank must not delay the others by its full
        # write timeout.
        threads = {rank: threading.Thread(target=send_one, args=(rank,), daemon=True,
                                          name=f"meshkit-scatter-{rank}") for rank in targets}
        for thread in threads.values():
            thread.start()
        for thread in threads.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        for rank, thread in threads.items():
            if thread.is_alive():
                with lock:
                    failed.add(rank)
                self._declare_dead(
                    rank, f"the scatter of reduce round {round_no} was still being written "
                          f"after {budget:.1f} s (the stall timeout plus the payload at "
                          f"{MIN_SCATTER_BYTES_PER_SECOND >> 20} MiB/s): the rank reads too "
                          f"slowly")
                thread.join(self._timeout)
        return sorted(failed)

    def _abort(self, round_no: int, expected: set[int], error: str, reason: str) -> None:
        """Tell every waiting worker the round failed, so none continues from a local value."""
        if self._ledger.closed:
            return
        # Every rank expected in the round hears it, including those that have not
        # contributed yet: their all_reduce for this round must fail too.
        for rank in sorted(expected - {0}):
            if self._ledger.is_dead(rank):
                continue
            try:
                self._send(
                    Message(0, rank, TAG_SCATTER, {},
                            {"round": round_no, "error": error, "reason": reason}, "control"),
                    None)
            except (PeerLostError, WireError, OSError) as exc:
                log.warning("could not tell rank %d that round %d failed: %s", rank, round_no,
                            exc)
