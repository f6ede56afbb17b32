"""Where a member's failure is decided: its rank dropped for the round, its client's, or the run's.

Rule (``[strategy] accept_failures = true``, the default, as Flower's): a
member's failure costs that member, never the run. Every round path asks
this module what a failure means instead of deciding itself.

* **A rank's failure** -- an ``error`` reply, or a contribution that does
  not match the round's model or holds NaN or inf (a breach found at the
  boundary, :func:`meshkit.train._messages.check_contribution`) -- drops
  that rank for the rest of the round: whatever it held or was doing is
  served again by the others, and the round's report names it with the
  reason (``failed``); it is not dead. A reply that breaks its schema, a
  disconnect or a stall is the pool's to judge: it declares that rank dead
  (``dropped``), and its work is served again the same way.
* **A client's failure** -- the same client failing on two different ranks
  (an ``error`` naming its fit, a breach of its contribution, a stall while
  fitting it): the failure is the client's (a deterministic bug, a model
  that diverges on its data), so it is not served again this round; it is
  recorded in ``not_served`` naming both ranks, and the second rank is not
  blamed (the first sat out the rest of the round already; its strike is
  withdrawn). One hostile rank cannot get an honest client refused: that
  takes two ranks failing it. A client whose fit *stalled* two ranks (each
  try cost a worker) is not tried again in the run, nor after a --resume
  (``StrategyContext.stalled_clients``). A round with one live worker (a collective
  rank serving its own slice) has no second rank to ask: there a failure is the
  client's at once, and the rank serves the rest of its slice.
* **Quarantine.** A rank dropped for its own failure in
  :data:`QUARANTINE_AFTER` rounds of a run is declared dead for the run
  (``quarantined: ...``): a broken or hostile node stops costing every round
  a re-serve. A restarted node (same rank, a fresh process) is taken back as
  any returning rank is, and starts with no strikes.
* ``accept_failures = false`` (debugging a trusted cluster): any member
  failure stops the run with :class:`~meshkit.WorkerError` naming the rank
  and the reason.

A fit whose *metrics* are not finite (``train_loss = nan``) is not a
member's failure but the model's: the worker says so (``reason =
"nonfinite"``) and the run follows ``[strategy] on_nonfinite``
(:class:`DivergedFit`, handled by :func:`meshkit.train.run_rounds`).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import attrs

from meshkit.errors import AggregationError, StateError, WorkerError

__all__ = ["RoundFailures", "DivergedFit", "QUARANTINE_AFTER", "OWN_FAILURE", "reply_failure",
           "strike"]

log = logging.getLogger(__name__)

#: Rounds in which a rank may fail before it is quarantined for the run.
QUARANTINE_AFTER = 3

#: How the reason of a client's own failure begins (``not_served``; a host relay's
#: answer lists those keys in ``own`` so the coordinator does not serve them again).
OWN_FAILURE = "failed on "


class DivergedFit(StateError):
    """A fit reported non-finite metrics: the model diverged (``[strategy] on_nonfinite``)."""


def reply_failure(rank: int, payload: Mapping[str, Any], *, accept: bool) -> str | None:
    """The member failure an ``error`` reply carries ("" never: None when it carries none).

    A fit's non-finite metrics are the model's, not the member's
    (:class:`DivergedFit`); without ``accept`` (``accept_failures = false``)
    any error stops the run as it always did.
    """
    error = payload.get("error")
    if not error:
        return None
    reason = payload.get("reason")
    if reason == "nonfinite":
        raise DivergedFit(f"rank {rank}: {error}")
    if not accept:
        if reason == "aggregation":
            raise AggregationError(f"rank {rank}: {error}")
        raise WorkerError(rank, str(error))
    return f"error: {error}"


@attrs.define
class RoundFailures:
    """One round's member failures: which ranks sat it out, which clients failed (module rule)."""

    accept: bool = True
    #: Ranks dropped for the round for their own failure -> the reason.
    ranks: dict[int, str] = attrs.Factory(dict)
    #: Each client that failed somewhere -> {rank: reason}.
    tries: dict[int, dict[int, str]] = attrs.Factory(dict)
    #: Clients whose failure is their own (two ranks) -> the reason shown in ``not_served``.
    clients: dict[int, str] = attrs.Factory(dict)
    #: Ranks a client must fail on to be its own failure: 2, or 1 where a round has one
    #: worker (a collective rank's own trainer: nobody else could serve it anyway).
    needed: int = 2

    def rank_failed(self, rank: int, reason: str) -> None:
        """``rank`` sits out the rest of the round (:class:`~meshkit.WorkerError` when not
        accepting failures)."""
        if not self.accept:
            raise WorkerError(rank, reason)
        self.ranks.setdefault(rank, reason)
        log.warning("rank %d dropped for this round: %s", rank, reason)

    def client_failed(self, key: int, rank: int, reason: str) -> bool:
        """``key`` failed on ``rank``; True when that makes the failure the client's own
        (a second rank), so it must not be served again this round."""
        tries = self.tries.setdefault(key, {})
        tries[rank] = reason
        if len(tries) < self.needed:
            return False
        shown = "; ".join(f"rank {r}: {why}" for r, why in sorted(tries.items()))
        self.clients[key] = (f"{OWN_FAILURE}{len(tries)} ranks, so the failure is its own "
                             f"({shown})" if len(tries) > 1
                             else f"{OWN_FAILURE}its only worker ({shown})")
        for other in tries:
            self.ranks.pop(other, None)  # the client's fault, not theirs
        log.warning("client %d failed on ranks %s: not served again this round", key,
                    ", ".join(map(str, sorted(tries))))
        return True


def strike(ctx: Any, failures: RoundFailures) -> None:
    """Count a round's rank failures against the run; quarantine a rank at
    :data:`QUARANTINE_AFTER` (declared dead through the pool, with the reason)."""
    strikes: dict[int, int] = ctx.strikes
    for rank, reason in sorted(failures.ranks.items()):
        strikes[rank] = strikes.get(rank, 0) + 1
        if strikes[rank] >= QUARANTINE_AFTER and rank not in ctx.pool.dead:
            ctx.pool.declare_dead(rank, f"quarantined: failed in {strikes[rank]} rounds "
                                        f"(last: {reason})")
