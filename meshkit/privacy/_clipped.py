"""The exact sum of clipped updates a private round releases, wherever it is folded.

Rule (docs/privacy.md, "The mechanism" and "Folding per worker"): each
client's update Δ = model − global (float64, floating-point arrays only,
:func:`~meshkit.privacy.float_keys`) is scaled by min(1, S'/‖Δ‖) and
rounded to a multiple of 2^-F into an exact int64 sum (the rule of
:class:`~meshkit.aggregation.FixedPointSum`, weight 1: every client counts
once). S' sits just below the clip norm S, by the rounding's own worst case
(√d·2^-(F+1) over d coordinates) and a relative 1e-12 for the float64 norm,
so every *rounded* clipped update has norm ≤ S: the sum's sensitivity is S.

Integer sums do not depend on order or split, so the coordinator folding
each update (:meth:`ClippedSum.add`) and a worker folding its clients and
handing over one partial (:meth:`ClippedSum.partial`, merged with
:meth:`ClippedSum.merge`) give the same bits, whichever worker served which
client. A merged partial of n updates is clipped to n·S first: an honest
one is untouched (n rounded clipped updates have norm ≤ n·S), and a worker
that did not clip moves the sum by no more than n clients could.

F (:func:`clip_bits`) is chosen from S alone, so every party agrees on it:
the largest F ≤ 62 with S·2^F ≤ 2^(62 − :data:`COHORT_BITS`). Each rounded
term is then at most 2^38 units (S·2^F + ½), and an int64 accumulator holds
at least 2^24 of them (:attr:`ClippedSum.max_count`). At S = 1 the
resolution is 2^-38 ≈ 3.6e-12, far below a float32's rounding of any
update worth releasing.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping

import numpy as np

from meshkit.aggregation import FixedPartial, squared_norm
from meshkit.errors import AggregationError
from meshkit.privacy._clip import float_keys

__all__ = ["ClippedSum", "clip_bits", "COHORT_BITS", "one_bit"]

log = logging.getLogger(__name__)

#: log2 of the contributions one round's sum is sized for (module docstring).
COHORT_BITS = 24
#: How far below S an update is clipped for the float64 norm's own rounding (relative).
NORM_MARGIN = 1e-12
#: How far past S a client-clipped update may come before a warning (rounding of
#: global + update − global in the model's dtype); it is clipped here either way.
CLIENT_SLACK = 1e-5
_INT64_MAX = (1 << 63) - 1
#: Elements per step of a pass (512 KiB of float64: a core's cache holds it).
_CHUNK = 1 << 16


def clip_bits(clip_norm: float) -> int:
    """The fraction bits F of the exact sum at clip norm S (module docstring)."""
    if not (math.isfinite(clip_norm) and clip_norm > 0):
        raise ValueError(f"clip_norm must be a finite number > 0, got {clip_norm!r}")
    return max(0, min(62, math.floor(62 - COHORT_BITS - math.log2(clip_norm))))


def one_bit(value: Any) -> int:
    """A client's ``unclipped`` report as the bit it must be: 1 only for exactly 1 (a hostile
    or broken report of -1e9 or 7 counts as 0: never more than one client)."""
    return 1 if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 1 \
        else 0


class ClippedSum:
    """The exact sum of clipped updates against ``reference`` at clip norm ``clip_norm``.

    :meth:`add` folds one contribution (a model) and returns its update's norm
    before clipping; :meth:`merge` folds another sum's :meth:`partial`;
    :meth:`total` gives the sum in float64. ``clipped_by_clients``: the
    contributions come clipped already (``clip = "client"``); one that does
    not is logged, and clipped here all the same. A privacy mechanism's fold
    subclasses it and releases the sum with its noise (:meth:`result`).

    The float keys are laid end to end in one int64 accumulator (and one
    float64 scratch of the same size), so a contribution costs a handful of
    numpy calls whatever the number of arrays; each pass goes chunk by chunk
    (:data:`_CHUNK` elements), so a large model is read from memory about
    twice, not once a numpy call.
    """

    def __init__(self, reference: Mapping[str, Any], *, clip_norm: float,
                 clipped_by_clients: bool = False, name: str = "privacy") -> None:
        self.reference = reference
        self.keys = float_keys(reference)
        self.clip_norm = float(clip_norm)
        self.fraction_bits = clip_bits(self.clip_norm)
        self.clipped_by_clients = clipped_by_clients
        self.name = name
        self._ref64 = {k: np.asarray(reference[k], np.float64) for k in self.keys}
        #: key -> (start, stop) in the flat accumulator.
        self._slots: dict[str, tuple[int, int]] = {}
        size = 0
        for key in self.keys:
            self._slots[key] = (size, size + int(reference[key].size))
            size += int(reference[key].size)
        self._acc = np.zeros(size, np.int64)
        self._wide = np.empty(size, np.float64)
        self._ints = np.empty(min(size, _CHUNK), np.int64)
        #: What each update is clipped to, so that its rounded value's norm is <= S.
        self.bound = (self.clip_norm * (1 - NORM_MARGIN)
                      - math.sqrt(size) * 2.0 ** -(self.fraction_bits + 1))
        if not self.bound > 0:
            raise ValueError(f"clip_norm {self.clip_norm:g} is below the exact sum's "
                             f"resolution over {size} coordinates; raise it")
        self._one = 2.0 ** self.fraction_bits
        #: The most contributions the int64 sums hold (each rounded term <= S·2^F + ½).
        self.max_count = _INT64_MAX // math.ceil(self.clip_norm * self._one + 1)
        self._count = 0
        self._handed = False
        #: Contributions whose update was within S before clipping (adaptive clipping).
        self.unclipped = 0
        #: Each added contribution's norm before clipping, and after (each <= S).
        self.norms: list[float] = []
        self.clipped_norms: list[float] = []

    @property
    def count(self) -> int:
        """Contributions in the sum (a merged partial counts its own)."""
        return self._count

    def add(self, state: Mapping[str, Any], weight: float = 1.0, *,
            source: str | None = None) -> float:
        """Fold ``state``'s update, clipped; its norm before clipping. ``weight`` is
        ignored: every client counts once (user-level privacy)."""
        who = source or f"contributor #{self.count}"
        self._room(1, who)
        wide = self._wide
        values = []
        for key in self.keys:
            if key not in state:
                raise AggregationError(f"{self.name}: {who} lacks key {key!r}")
            value = np.asarray(state[key])
            if value.shape != self._ref64[key].shape:
                raise AggregationError(
                    f"{self.name}: {who} key {key!r} has shape {value.shape}, the global "
                    f"model {self._ref64[key].shape}")
            values.append(value.reshape(-1))
        total = 0.0
        with np.errstate(over="ignore", invalid="ignore"):
            for key, value in zip(self.keys, values):  # the update, in float64, and its norm
                start, stop = self._slots[key]
                ref = self._ref64[key].reshape(-1)
                for a in range(0, stop - start, _CHUNK):
                    b = min(a + _CHUNK, stop - start)
                    part = wide[start + a:start + b]
                    np.subtract(value[a:b], ref[a:b], out=part, dtype=np.float64)
                    total += squared_norm(part)
        if not math.isfinite(total):  # a NaN or an infinity (or a norm beyond float64)
            bad = next((k for k in self.keys
                        if not np.isfinite(wide[slice(*self._slots[k])]).all()), self.keys[0])
            raise AggregationError(f"{self.name}: {who} key {bad!r} is not finite")
        norm = math.sqrt(total)
        if self.clipped_by_clients and norm > self.clip_norm * (1 + CLIENT_SLACK):
            log.warning("%s: %s sent an update of norm %.6g with clip = \"client\" and S = "
                        "%.6g: clipped here to keep the guarantee", self.name, who, norm,
                        self.clip_norm)
        scale = min(1.0, self.bound / norm) if norm > 0 else 1.0
        # x·scale, rounded to 2^-F: one product (scale·2^F is exact, a power of two apart)
        factor = scale * self._one
        for a in range(0, len(wide), _CHUNK):
            b = min(a + _CHUNK, len(wide))
            part, ints = wide[a:b], self._ints[:b - a]
            np.multiply(part, factor, out=part)
            np.rint(part, out=part)
            np.copyto(ints, part, casting="unsafe")
            np.add(self._acc[a:b], ints, out=self._acc[a:b])
        self._count += 1
        self.norms.append(norm)
        self.clipped_norms.append(norm * scale)
        self.unclipped += norm <= self.clip_norm
        return norm

    def merge(self, partial: FixedPartial, *, unclipped: int = 0,
              source: str | None = None) -> None:
        """Fold another sum's partial of ``partial.count`` clipped updates, clipped here to
        count·S (module docstring); ``unclipped`` of them were within S (at most all)."""
        who = source or "a partial sum"
        if partial.fraction_bits != self.fraction_bits:
            raise AggregationError(f"{self.name}: {who} counts in 2^-{partial.fraction_bits}, "
                                   f"this round's sum in 2^-{self.fraction_bits}")
        keys = sorted(partial.order)
        if keys != self.keys or sorted(partial.sums) != self.keys or partial.exact \
                or partial.json:
            raise AggregationError(f"{self.name}: {who} holds {keys[:5]}, not the float keys "
                                   f"of the model {self.keys[:5]}")
        for key in self.keys:
            sums = partial.sums[key]
            if not isinstance(sums, np.ndarray) or sums.dtype != np.int64 \
                    or sums.shape != self._ref64[key].shape:
                raise AggregationError(
                    f"{self.name}: {who} key {key!r} is not an int64 sum of shape "
                    f"{self._ref64[key].shape}")
        if partial.count < 0:
            raise AggregationError(f"{self.name}: {who} claims {partial.count} updates")
        self._room(partial.count, who)
        units = math.sqrt(sum(squared_norm(partial.sums[k]) for k in self.keys))
        limit = partial.count * self.clip_norm * self._one
        factor = 1.0
        if units > limit:
            log.warning("%s: %s of %d updates has norm %.6g > %d x S = %.6g: clipped here "
                        "(its sender did not clip)", self.name, who, partial.count,
                        units / self._one, partial.count, partial.count * self.clip_norm)
            factor = partial.count * self.bound * self._one / units
        for key in self.keys:
            start, stop = self._slots[key]
            sums = partial.sums[key].reshape(-1)
            if factor != 1.0:
                sums = np.rint(sums * factor).astype(np.int64)
            np.add(self._acc[start:stop], sums, out=self._acc[start:stop])
        self._count += partial.count
        self.unclipped += max(0, min(int(unclipped), partial.count))

    def _room(self, count: int, who: str) -> None:
        if self._handed:
            raise AggregationError(f"{self.name}: this sum was handed on already")
        if self._count + count > self.max_count:
            raise AggregationError(f"{self.name}: {who} would take the round's sum past "
                                   f"{self.max_count} clipped updates, the most its int64 "
                                   f"sums hold at S = {self.clip_norm:g}")

    def partial(self) -> FixedPartial:
        """Hand the sum on (a worker's reply): its int64 sums, ``count`` and mass (weight 1
        each, as :class:`~meshkit.aggregation.FixedPointSum` counts it); this sum is
        finished."""
        if self._count == 0:
            raise AggregationError(f"{self.name}: no contributions to hand on")
        self._handed = True
        sums = {k: self._acc[slice(*self._slots[k])].reshape(self._ref64[k].shape)
                for k in self.keys}
        return FixedPartial(self.fraction_bits, self._count * round(self._one), self._count,
                            sums=sums, dtypes={k: np.dtype(np.float64) for k in self.keys},
                            order=list(self.keys))

    def total(self) -> dict[str, np.ndarray]:
        """The sum of the clipped updates, float64 per float key (zeros when empty)."""
        unit = 1.0 / self._one
        return {k: self._acc[slice(*self._slots[k])].astype(np.float64).reshape(
            self._ref64[k].shape) * unit for k in self.keys}

    def result(self) -> dict[str, Any]:
        """The released model: a privacy mechanism's fold adds its noise (never this sum)."""
        raise NotImplementedError(f"{type(self).__name__} releases no sum without noise")
