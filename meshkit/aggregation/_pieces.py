"""A contribution folded piece by piece: :func:`piece_plan` cuts it, :class:`PieceFold` sums it.

Rule: a contribution's float arrays, flat and in key order, are cut into
*pieces* of at most ``piece_bytes`` bytes (a piece boundary may fall inside
an array; an array never starts a piece half-way through an element); its
integer, bool and JSON entries go whole with piece 0. Both ends compute the
cut from the model alone (:func:`piece_plan`), so a piece carries only its
slices, and the receiver knows what each must be before it arrives.

:class:`PieceFold` feeds the pieces of each contribution, in turn, into a
:class:`~meshkit.aggregation.MeanFold`'s running sum as they arrive, so the
coordinator never holds a whole contribution. Each contribution goes
straight into the sum, one at a time: the fold is set to ``retain = 0``
(a ``retain = 1`` fold is accepted and switched). That is what ``retain``
can mean here: it holds *references* to whole contributions so a pair is
summed in cache before the sum is touched, and a contribution that comes in
pieces never exists whole -- holding a pair's first member would take a
model-sized copy of it (the buffer this module kept until issue 36: one
model copy of coordinator memory, 38 MiB at 10M parameters), and that copy
saves no traffic (the member is written to it and read back: six model-sized
streams a pair either way, and as many numpy passes). The result is the
*same bits* as ``fold.add(whole, weight)`` per contribution followed by
``fold.result()`` on a ``retain = 0`` fold: every element goes through the
very same operations in the same order.

A contribution given up half-way (its worker lost, a piece that does not
fit) is taken back exactly when nothing of it reached the sum yet (the
first contribution of a round: :meth:`abort` says so); otherwise the sum
holds part of it and the fold is unusable -- the caller plays the round
again the whole-contribution way, on a ``retain = 0`` fold too
(:func:`one_at_a_time`), so a replayed round has the bits a round in pieces
would have had.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from meshkit.aggregation._json import json_accumulate
from meshkit.aggregation._mean import MeanFold, _ExactEntry, _FloatEntry
from meshkit.errors import AggregationError
from meshkit.state import is_array, is_float_dtype

__all__ = ["DEFAULT_PIECE_BYTES", "PieceFold", "float_layout", "one_at_a_time", "piece_plan"]

#: Bytes of one piece of a contribution, by default (32 MiB).
DEFAULT_PIECE_BYTES = 32 << 20

#: One piece: ``(key, lo, hi)`` element ranges of the flat float arrays it carries.
Piece = list[tuple[str, int, int]]


def float_layout(state: Mapping[str, Any]) -> list[tuple[str, int, int]]:
    """``(key, itemsize, size)`` of each float array of ``state``, in key order."""
    return [(key, np.asarray(value).dtype.itemsize, int(np.asarray(value).size))
            for key, value in sorted(state.items())
            if is_array(value) and is_float_dtype(np.asarray(value).dtype)]


def piece_plan(layout: Sequence[tuple[str, int, int]], piece_bytes: int) -> list[Piece]:
    """The pieces of a contribution whose float arrays are ``layout`` (:func:`float_layout`).

    Each piece holds at most ``piece_bytes`` bytes (at least one element);
    there is always at least one piece (piece 0 carries the other entries).
    """
    if piece_bytes < 1:
        raise ValueError(f"piece_bytes must be at least 1, got {piece_bytes}")
    pieces: list[Piece] = [[]]
    room = piece_bytes
    for key, itemsize, size in layout:
        lo = 0
        while lo < size:
            fits = room // itemsize
            if fits == 0:
                if pieces[-1]:
                    pieces.append([])
                    room = piece_bytes
                    continue
                fits = 1  # a piece smaller than one element still carries one
            hi = min(size, lo + fits)
            pieces[-1].append((key, lo, hi))
            room -= (hi - lo) * itemsize
            lo = hi
            if room <= 0 or (lo < size and room < itemsize):
                pieces.append([])
                room = piece_bytes
    if len(pieces) > 1 and not pieces[-1]:
        pieces.pop()
    return pieces


def one_at_a_time(fold: MeanFold) -> MeanFold:
    """``fold`` (empty) set to sum each contribution straight into its sum (``retain = 0``),
    as a fold fed in pieces does; a fold that groups more (``retain`` of 2 or more, or
    None) is refused: it asks for the memory a fold in pieces exists to save."""
    if fold.retain not in (0, 1):
        raise ValueError(f"a fold in pieces sums one contribution at a time; a fold with "
                         f"retain = {fold.retain} asks to hold more (give it whole "
                         f"contributions)")
    if fold.count or fold._pending:
        raise ValueError("a fold is set to sum one at a time before anything is added")
    fold.retain = 0
    return fold


class PieceFold:
    """``fold``'s running sum, fed one piece at a time (module docstring).

    ``model`` gives every float array's shape and dtype (the round's model);
    ``plan`` is :func:`piece_plan` of it. Per contribution: :meth:`begin`,
    then :meth:`piece` for piece 0, 1, ... in order (piece 0 with the other
    entries), then :meth:`end`; or :meth:`abort`. :meth:`result` is the
    fold's result.
    """

    def __init__(self, fold: MeanFold, model: Mapping[str, Any], plan: list[Piece]) -> None:
        if fold.count or fold._pending:
            raise ValueError("a PieceFold starts from an empty fold")
        self.fold, self.plan = fold, plan
        #: Zero-memory stand-ins with each float array's shape and dtype (for the fold's checks).
        self._standins = {key: np.broadcast_to(np.zeros((), np.asarray(value).dtype),
                                               np.shape(value))
                          for key, value in model.items()
                          if is_array(value) and is_float_dtype(np.asarray(value).dtype)}
        #: The model's other keys (integer and bool arrays, JSON): they come with piece 0.
        self._others = set(model) - set(self._standins)
        one_at_a_time(fold)  # every contribution straight into the sum (module docstring)
        # The contribution being received: (weight, factor, label), its next piece, and
        # whether any of it reached the sum.
        self._current: tuple[float, float, str] | None = None
        self._next = 0
        self._touched = False
        self._rest: dict[str, Any] = {}

    @property
    def receiving(self) -> bool:
        return self._current is not None

    def begin(self, weight: float, source: str) -> None:
        """A new contribution of ``weight`` (its refusals are the fold's own)."""
        if self._current is not None:
            raise ValueError("a contribution is already being received")
        w, factor = self.fold._admit(weight, source)  # the fold's own rule and refusals
        if factor is None:
            # The whole-contribution fold rebases its sum onto this weight (every
            # contribution so far rescaled before this one is added); pieces cannot.
            raise self._broken(
                f"{source}'s weight is more than 2^40 times the first one's; the sum is "
                f"rebased then, which needs whole contributions")
        self._current, self._next, self._touched, self._rest = (w, factor, source), 0, False, {}

    def piece(self, index: int, parts: Mapping[str, Any]) -> None:
        """Piece ``index`` of the contribution: its slices (key -> flat array), and with
        piece 0 its other entries. Checked before anything is summed."""
        if self._current is None or index != self._next:
            raise ValueError(f"piece {index} out of turn (expected {self._next})")
        _, factor, label = self._current
        fold = self.fold
        want = self.plan[index]
        slices = {key for key, _, _ in want}
        if index == 0:
            rest = {k: v for k, v in parts.items() if k not in self._standins}
            if set(rest) != self._others:
                raise AggregationError(
                    f"{fold.name}: piece 0 of {label} does not carry the model's other "
                    f"entries (missing {sorted(self._others - set(rest))[:5]}, unknown "
                    f"{sorted(set(rest) - self._others)[:5]})")
            self._rest = rest
        got = {k for k in parts if k in self._standins} if index == 0 else set(parts)
        if got != slices:
            raise AggregationError(f"{fold.name}: piece {index} of {label} does not carry "
                                   f"the planned arrays (got {sorted(got)[:5]}, planned "
                                   f"{sorted(slices)[:5]})")
        xs = []
        for key, lo, hi in want:
            x = parts[key]
            model = self._standins[key]
            if not isinstance(x, np.ndarray) or x.ndim != 1 or x.dtype != model.dtype \
                    or x.size != hi - lo:
                raise AggregationError(
                    f"{fold.name}: piece {index} of {label}: {key!r}[{lo}:{hi}] should be a "
                    f"flat {model.dtype} array of {hi - lo} elements")
            xs.append((key, lo, hi, x))
        if index == 0:
            self._check(label)
        first = fold.count == 0
        jobs = [(key, self._acc(key)[lo:hi], [(x, factor)]) for key, lo, hi, x in xs]
        self._touched = self._touched or not first
        self._fold(jobs, init=first, label=label)
        self._next += 1

    def end(self) -> None:
        """Every piece arrived: the contribution counts (its JSON entries are folded now)."""
        if self._current is None or self._next != len(self.plan):
            raise ValueError(f"{len(self.plan) - self._next} pieces still to come")
        w, factor, label = self._current
        fold = self.fold
        assert fold._entries is not None
        for key, entry in fold._entries.items():
            if not isinstance(entry, (_FloatEntry, _ExactEntry)):
                json_accumulate(entry, self._rest[key], factor)
        fold._started = True
        if fold.weighted and fold._reference is None and w > 0:
            fold._reference = w
        fold.sources.append(label)
        fold.weights.append(w)
        fold._factors.append(factor)
        self._current = None

    def abort(self) -> bool:
        """Give up the contribution being received; True when nothing of it is left in the
        sum, False when the sum holds part of it (the fold is then unusable)."""
        if self._current is None:
            return True
        label = self._current[2]
        self._current = None
        if self._touched:
            self.fold._broken = f"{label} was given up half-way, after part of it was summed"
            return False
        if self.fold.count == 0:
            self.fold._entries = None  # its other entries were the template: forget them
        return True

    def result(self) -> dict[str, Any]:
        """The fold's result."""
        if self._current is not None:
            raise ValueError("a contribution is still being received")
        return self.fold.result()

    # -- internals ----------------------------------------------------------------------

    def _check(self, label: str) -> None:
        """Piece 0: the contribution's keys, shapes, dtypes and other entries, by the fold's
        own rules (the float arrays as stand-ins), before anything is summed."""
        fold = self.fold
        whole = {**self._standins, **self._rest}
        if fold._entries is None:
            plan = fold._plan(whole, label)
            for key in self._standins:  # no stand-in is ever written: allocate for real
                plan[key] = self._standins[key]
            fold._entries = fold._allocate(plan)
            fold._started = False
        else:
            fold._check_compatible(whole, label)

    def _acc(self, key: str) -> np.ndarray:
        assert self.fold._entries is not None
        entry = self.fold._entries[key]
        assert isinstance(entry, _FloatEntry)
        return entry.acc

    def _fold(self, jobs: list[tuple[str, np.ndarray, list[tuple[np.ndarray, float]]]], *,
              init: bool, label: str) -> None:
        self.fold._fold_or_refuse(jobs, init, None, lambda job: [({}, job[2][0][1], label)])

    def _broken(self, why: str) -> AggregationError:
        self.fold._broken = why
        return AggregationError(f"{self.fold.name}: {why}")

