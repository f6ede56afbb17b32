"""The flat round with contributions pulled and folded piece by piece (issue 39).

Rule: when the round's fold is the engine's own strict mean (the round may
be replayed, :mod:`.engine` step 7) and the model's float arrays are larger
than one piece (``ctx.piece_bytes``, default 32 MiB), every fit's result
stays on its worker (``keep``) and the coordinator pulls the contribution
the fold waits on with ``take`` one piece at a time (``piece``,
``piece_bytes``), folding each piece into the running sum as it arrives
(:class:`meshkit.aggregation.PieceFold`): it never holds a whole
contribution, and no message of the round is larger than a piece plus its
header. Contributions are summed one at a time (:func:`meshkit.aggregation.one_at_a_time`:
no pair's first member is kept, a model copy saved); the result is, bit for
bit, the whole-contribution fold's with ``retain = 0``, and so is a replay's.

The pull is pipelined: up to :data:`AHEAD` pieces of the contribution are
asked for at once, and the next is asked for *before* the piece that just
arrived is folded, so the worker sends (and the link's reader receives)
pieces ``k + 1`` and ``k + 2`` while the coordinator folds piece ``k``
rather than waiting for the request a fold finishes with. The coordinator
has at most :data:`AHEAD` pieces of it in flight besides the one it folds
(they arrive, and are folded, in order: a worker answers its requests one
after another), so it holds at most ``AHEAD + 1`` pieces: one folded, one
queued, one being read.

A worker lost (or a piece that does not fit the model) while its
contribution is being pulled: when nothing of that contribution reached the
sum yet, it is given up and its key served again like any lost work;
otherwise the sum holds part of it, the round stops with an
:class:`~meshkit.AggregationError` and the engine plays it again the
whole-contribution way (its replay, with every contribution scanned), so
the result never holds a partial contribution.

Everything else -- a round deadline, local keys, compression, an attack, a
fold that is not the strict mean, a model within one piece -- plays the
whole-contribution round unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from meshkit.aggregation import MeanFold, PieceFold, float_layout, piece_plan
from meshkit.errors import AggregationError, ProtocolError
from meshkit.state import FLOAT_DTYPE_SET, is_array, is_float_dtype
from meshkit.train._messages import check_contribution
from meshkit.train._messages.check import Signature
from meshkit.train._pool import protocol_reason

__all__ = ["AHEAD", "PieceRound", "pieces_apply"]

#: Pieces of one contribution asked for and not folded yet, at most (docstring above):
#: two let a piece travel while the one before it is folded; more would only add
#: memory (each is a piece-sized message on the coordinator).
AHEAD = 2


def pieces_apply(fold: Any, reference: Mapping[str, Any] | None,
                 requests: Mapping[int, Mapping[str, Any]], piece_bytes: int) -> bool:
    """Whether a flat round (already known to replay: the strict mean, no given fold, no
    attack) pulls its contributions in pieces: every request a fit, the fold the
    strict mean summing in pairs or one by one, and a model above one piece."""
    if reference is None or type(fold) is not MeanFold or fold.retain not in (0, 1) \
            or fold.count:
        return False
    if not requests or any(r.get("op") != "fit" for r in requests.values()):
        return False
    # float_layout's bytes, summed without its sorted list (asked every flat round).
    size = 0
    for value in reference.values():
        if type(value) is np.ndarray and value.dtype in FLOAT_DTYPE_SET:
            size += value.nbytes  # the common key, without two calls (issue 36)
        elif is_array(value):
            value = np.asarray(value)
            if is_float_dtype(value.dtype):
                size += value.nbytes
    return size > piece_bytes


class PieceRound:
    """What the flat round (:class:`meshkit.train._rounds.flat.FlatRound`) does differently
    when its contributions come in pieces: mixed in before it."""

    # FlatRound supplies these (a mixin reads them, mypy checks them there).
    ctx: Any
    fold: Any
    window: int
    inline: int
    unfolded: list[int]
    held: dict[int, set[int]]
    replies: dict[int, Mapping[str, Any]]
    served: dict[int, int]
    label: str
    weight: Any
    not_served: dict[int, str]
    expected: Signature | None
    busy: dict[int, tuple[int, str, Any]]

    def use_pieces(self, reference: Mapping[str, Any], piece_bytes: int) -> None:
        """Pull and fold in pieces of ``piece_bytes`` (``reference``: the round's model)."""
        self.piece_bytes = piece_bytes
        plan = piece_plan(float_layout(reference), piece_bytes)
        self.pieces = PieceFold(self.fold, reference, plan)
        self.plan_size = len(plan)
        floats = {key for key, _, _ in float_layout(reference)}
        self.others: Signature | None = None if self.expected is None else {
            k: v for k, v in self.expected.items() if k not in floats}
        #: The worker whose contribution is being pulled: rank -> (key, next piece to
        #: arrive); and the next piece to ask it for (at most AHEAD ahead of the first).
        self.pulling: dict[int, tuple[int, int]] = {}
        self.asked: dict[int, int] = {}
        # Every result is kept and pulled here: none comes back with its fit's answer.
        self.window = self.inline = 0
        # The round's result is the piece fold's (play_round asks self.fold).
        self.fold = self.pieces

    # -- the scheduler's hooks -----------------------------------------------------------

    def run(self, keys: int) -> None:
        """The scheduler's loop, its bound counting each piece of a key as a reply."""
        super().run(keys * self.plan_size)  # type: ignore[misc]

    def hand_out(self, rank: int, busy: set[int]) -> bool:
        """The next piece of the contribution it is handing over; else, when it holds the
        key the fold waits on and nothing else is being pulled, that key's first piece;
        else new work (always kept)."""
        if rank in self.pulling:  # (idle while pulling: nothing of it is in flight)
            key, piece = self.pulling[rank]
            self.asked[rank] = piece
            self._ask(rank, key)
            return True
        held = self.held.get(rank)
        if held and not self.pulling and self.unfolded and self.unfolded[0] in held:
            key = self.unfolded[0]
            held.discard(key)
            self.pieces.begin(self.weight(self.replies[key]),
                              f"{self.label} {key} (rank {rank})")
            self.pulling[rank] = (key, 0)
            self.asked[rank] = 0
            self._ask(rank, key)
            return True
        return super().hand_out(rank, busy)  # type: ignore[misc]

    def answered(self, rank: int, kind: str, key: int | None,
                 payload: Mapping[str, Any]) -> None:
        if kind != "take":
            super().answered(rank, kind, key, payload)  # type: ignore[misc]
            return
        assert key is not None and self.pulling.get(rank, (None, 0))[0] == key
        piece = self.pulling[rank][1]
        parts = payload["state"]
        # This piece is off the wire: the next AHEAD travel while it is checked and folded
        # (docstring). The window counts from the next piece to arrive, so it moves now,
        # not once the fold is done (which asked for nothing until the next piece came).
        self.pulling[rank] = (key, piece + 1)
        self._ask(rank, key)
        what = f"rank {rank}'s piece {piece} of {self.label} {key}"
        try:
            if piece == 0 and self.others is not None:
                rest = {k: v for k, v in parts.items() if k in self.others}
                check_contribution(rest, self.others, what, subset=True, finite=False)
            self.pieces.piece(piece, parts)
        except (ProtocolError, AggregationError) as exc:
            if self.pieces.fold._broken is not None:
                raise  # the sum refused it (NaN, out of range): the engine replays
            # It does not fit the model: its sender's (engine step 6); a failed rank is
            # lost for the round (requeue below gives the contribution up).
            self.failed(rank, "take", key, key, protocol_reason(  # type: ignore[attr-defined]
                exc if isinstance(exc, ProtocolError) else ProtocolError(str(exc))))
            return
        if piece + 1 < self.plan_size:
            return
        del self.pulling[rank]
        del self.asked[rank]
        self.pieces.end()
        self.unfolded.pop(0)
        self.served[key] = rank

    def requeue(self, rank: int, kind: str, key: int | None, reason: str) -> list[int]:
        pulled = self._stop_pulling(rank)
        again: list[int] = super().requeue(rank, kind, key, reason)  # type: ignore[misc]
        if pulled is None:
            return again
        self._abandon_pull(rank, pulled[0], reason)
        return sorted({*again, pulled[0]} - set(self.not_served))

    def client_dropped(self, rank: int, kind: str, unit: int | None, key: int) -> None:
        pulled = self._stop_pulling(rank)
        if pulled is not None:
            self._abandon_pull(rank, pulled[0], "its client failed")
        super().client_dropped(rank, kind, unit, key)  # type: ignore[misc]

    # -- internals -----------------------------------------------------------------------

    def _ask(self, rank: int, key: int) -> None:
        """Ask ``rank`` for the next pieces of ``key``'s contribution, up to :data:`AHEAD`
        of them not arrived yet."""
        first = self.pulling[rank][1]
        while self.asked[rank] < min(first + AHEAD, self.plan_size):
            self._take(rank, key, self.asked[rank])
            self.asked[rank] += 1

    def _stop_pulling(self, rank: int) -> tuple[int, int] | None:
        """Forget the pull from ``rank`` (its (key, next piece), or None): the pieces still
        asked of it are abandoned in the pool, so a late answer is never folded."""
        self.asked.pop(rank, None)
        pulled = self.pulling.pop(rank, None)
        if pulled is not None:
            for ticket, (owner, kind, _) in list(self.busy.items()):
                if owner == rank and kind == "take":
                    del self.busy[ticket]
                    self.ctx.pool.abandon(ticket)
        return pulled

    def _take(self, rank: int, key: int, piece: int) -> None:
        self.send(rank, "take", key,  # type: ignore[attr-defined]
                  {"op": "take", "key": key, "piece": piece, "piece_bytes": self.piece_bytes},
                  self.ctx.timeout)

    def _abandon_pull(self, rank: int, key: int, reason: str) -> None:
        """The contribution being pulled from ``rank`` will not arrive whole."""
        if not self.pieces.abort():
            raise AggregationError(
                f"rank {rank} was lost ({reason}) while {self.label} {key}'s contribution was "
                f"being folded piece by piece, after part of it was summed; the round is "
                f"played again with whole contributions")
