"""Quantised updates summed exactly on one shared grid: :class:`CodeSum`, a worker's sum of its
clients' codes and the coordinator's sum of the workers' sums.

Rule: with ``[compression] clip_range = c`` and a dense ``integer_field``
compressor, every client of a linear round quantises its update onto the
*configuration's* grid, ``[-c, c]`` in ``L = 2**field_bits - 1`` steps
(:class:`~meshkit.compression.FieldCompressor`'s ``encode_field``, the grid
secure aggregation uses), so two clients' codes are integers on the same
grid and their weighted sum is an integer sum. A worker adds
``weight * code`` for each of its clients into int64 and sends that one sum
(packed at ``bit_length(mass * L)`` bits a coordinate), the summed weights
(``mass``) and the count; the coordinator adds the workers' sums the same
way and decodes once: ``mean = decode_field(T, count=mass) / mass``
(``T * 2c / L / mass - c``), the model's value being the reference plus it,
in float64, rounded to the model's dtype.

Why it is exact: integer addition is associative and commutative and never
rounds (the bound ``mass * L < 2**63`` is checked), so the total ``T`` is
the same integers whichever worker summed which clients, in whatever order
the sums arrive -- and equal to adding each client's codes one at a time
at the coordinator (:meth:`CodeSum.add`). The decoded mean is a pure
function of ``T`` and ``mass``: the same bits.

Weights: an integer weight (a client's examples, or 1) folds into the
integer sum exactly. A non-integer weight cannot: :meth:`CodeSum.add`
refuses it (the round engine never asks for one -- a weight that reads more
than examples plays the flat round, each client's payload on its own grid).

What a worker's sum reveals: the weighted sum of its clients' codes and the
total of their weights -- not any one client's update, unlike the per-client
payloads. The grid is the configuration's (``clip_range``), the same for
every client and round, so it reveals nothing of any update. A coordinate
beyond ``[-c, c]`` is clipped (biased, as secure aggregation's grid is);
inside it stochastic rounding keeps each code's expectation exact.

The keys sent whole (:func:`compressed_keys`: integers, JSON, buffers) go
through a :class:`~meshkit.aggregation.FixedPointSum` and travel as its
partial (``whole/...``), so they are the per-client fold's bits as well.
"""

from __future__ import annotations

import math
from typing import Any, Collection, Mapping

import numpy as np

from meshkit.aggregation import DEFAULT_FRACTION_BITS, FixedPartial, FixedPointSum
from meshkit.compression._fold import refuse_empty
from meshkit.compression._payload import compressed_keys, decode_field_sum, field_codes, key_seed
from meshkit.errors import AggregationError, ProtocolError, RefusedError
from meshkit.secure_aggregation import pack, packed_size, unpack, vector_dtype

__all__ = ["CodeSum", "GridTotal", "grid_codes", "parse_wire", "to_wire", "SUM", "SIZE",
           "WHOLE"]

#: A grid sum's wire entries: ``sum/KEY`` (packed integers), ``n/KEY`` (its coordinates),
#: ``whole/...`` (the keys sent whole's partial).
SUM, SIZE, WHOLE = "sum/", "n/", "whole/"
_INT64_MAX = (1 << 63) - 1


def grid_codes(compressor: Any, start: Mapping[str, Any], fitted: Mapping[str, Any], *,
               seed: int, clip_range: float, keys: Collection[str]) -> dict[str, np.ndarray]:
    """Each of ``keys``' update (``fitted - start``, float32 as a payload's) on the shared
    grid: int64 codes in ``[0, L]``, one a coordinate. A non-finite update is refused
    (:class:`~meshkit.AggregationError`): it has no code."""
    out = {}
    for index, key in enumerate(keys):
        update = (np.asarray(fitted[key], np.float64).ravel()
                  - np.asarray(start[key], np.float64).ravel()).astype(np.float32)
        if not np.isfinite(update).all():
            raise AggregationError(f"key {key!r}'s update holds NaN or inf; non-finite "
                                   f"values are refused")
        out[key] = field_codes(compressor, update, seed=key_seed(seed, index),
                               clip_range=clip_range, dtype=np.dtype(np.int64))
    return out


class CodeSum:
    """The exact weighted sum of clients' codes on the grid ``[-clip_range, clip_range]``
    (module docstring), against ``reference`` (the round's model).

    :meth:`add` takes one client's codes, :meth:`add_fit` one client's fit (the worker's
    side), :meth:`merge` another sum's :meth:`to_wire`; :meth:`result` is the mean.
    A refused contribution leaves the sum unchanged.
    """

    def __init__(self, compressor: Any, reference: Mapping[str, Any], *, clip_range: float,
                 raw: Collection[str] = (), name: str = "fedavg") -> None:
        if not (isinstance(clip_range, (int, float)) and math.isfinite(clip_range)
                and clip_range > 0):
            raise ValueError(f"clip_range must be a positive number, got {clip_range!r}")
        self.compressor, self.reference = compressor, reference
        self.clip_range, self.raw, self.name = float(clip_range), tuple(raw), name
        self.levels = (1 << int(compressor.field_bits)) - 1
        self.keys = compressed_keys(reference, self.raw)
        #: The keys that travel whole, summed by a FixedPointSum of their own.
        self.whole_keys = [k for k in reference if k not in set(self.keys)]
        self.whole = (FixedPointSum(DEFAULT_FRACTION_BITS, name=name)
                      if self.whole_keys else None)
        self.sizes = {k: int(np.asarray(reference[k]).size) for k in self.keys}
        self.sums = {k: np.zeros(n, np.int64) for k, n in self.sizes.items()}
        self.mass = 0  # the sum of the (integer) weights
        self.count = 0
        self.sources: list[str] = []

    # -- adding -------------------------------------------------------------------------

    def add_fit(self, start: Mapping[str, Any], fitted: Mapping[str, Any], weight: float, *,
                seed: int, source: str) -> None:
        """One client's fit from ``start``, quantised on the grid (seeded by its fit's
        ``seed``) and added with ``weight``."""
        codes = grid_codes(self.compressor, start, fitted, seed=seed,
                           clip_range=self.clip_range, keys=self.keys)
        self.add(codes, weight, whole={k: fitted[k] for k in self.whole_keys}, source=source)

    def add(self, codes: Mapping[str, np.ndarray], weight: float, *,
            whole: Mapping[str, Any] | None = None, source: str) -> None:
        """Add ``weight * codes`` (one client's, each in ``[0, L]``) and its whole keys."""
        w = self._integer_weight(weight, source)
        checked = {}
        for key, size in self.sizes.items():
            c = codes.get(key)
            if not isinstance(c, np.ndarray) or c.dtype.kind not in "ui" or c.shape != (size,):
                raise ProtocolError(f"{source}: key {key!r} needs {size} integer codes, got "
                                    f"{getattr(c, 'dtype', type(c).__name__)}"
                                    f"{list(getattr(c, 'shape', []))}")
            if size and (int(c.min()) < 0 or int(c.max()) > self.levels):
                raise ProtocolError(f"{source}: key {key!r} has a code outside "
                                    f"[0, {self.levels}]")
            checked[key] = c.astype(np.int64) * w
        self._fold(checked, w, 1, whole, source)

    def merge(self, wire: Mapping[str, Any], *, source: str,
              whole: Mapping[str, Any] | None = None) -> None:
        """Add another sum (its :meth:`to_wire`), checked like any message: a
        :class:`~meshkit.ProtocolError` naming what does not fit. ``whole``: the keys sent
        whole's signature (key -> (shape, dtype), :meth:`FixedPartial.matches`), checked
        when given."""
        mass, count, levels, sizes, sums, partial = parse_wire(wire, source)
        if levels != self.levels or sizes != self.sizes:
            raise ProtocolError(f"{source}: a grid sum of {levels}-level codes over "
                                f"{sorted(sizes.items())[:4]}; this round's are "
                                f"{self.levels}-level over {sorted(self.sizes.items())[:4]}")
        if (partial is None) != (self.whole is None):
            raise ProtocolError(f"{source}: its keys sent whole "
                                f"{'are missing' if partial is None else 'are not the model'}")
        mismatch = None if whole is None or partial is None else partial.matches(whole)
        if mismatch is not None:
            raise ProtocolError(f"{source}'s keys sent whole do not match the round's "
                                f"model: {mismatch}")
        self._fold(sums, mass, count, partial, source)

    # -- out ------------------------------------------------------------------------------

    def to_wire(self) -> dict[str, Any]:
        """This sum as a flat state: ``bits``, ``mass``, ``count``, ``levels``, ``n/KEY``
        (its coordinates), ``sum/KEY`` (packed at ``bits``, the narrowest width
        ``mass * levels`` fits) and ``whole/...`` (the keys sent whole's partial)."""
        whole = self.whole.partial() if self.whole is not None and self.count else None
        return to_wire(self.sums, self.mass, self.count, self.levels, whole)

    def wire_bytes(self) -> int:
        """The bytes :meth:`to_wire`'s sums take (framing and names not counted)."""
        bits = max(1, (self.mass * self.levels).bit_length())
        return sum(packed_size(n, bits) for n in self.sizes.values())

    def result(self) -> dict[str, Any]:
        """The weighted mean: the reference plus the decoded mean update, per key in the
        model's dtype; the keys sent whole as their FixedPointSum's mean."""
        refuse_empty(self.name, self.count, self.mass)
        rest = self.whole.result() if self.whole is not None else {}
        out: dict[str, Any] = {}
        for key, ref in self.reference.items():
            if key not in self.sums:
                out[key] = rest[key]
                continue
            update = decode_field_sum(self.compressor, self.sums[key],
                                      clip_range=self.clip_range, count=self.mass)
            update /= float(self.mass)
            ref = np.asarray(ref)
            update += ref.astype(np.float64).ravel()
            out[key] = update.astype(ref.dtype).reshape(ref.shape)
        return out

    # -- internals ------------------------------------------------------------------------

    def _integer_weight(self, weight: float, source: str) -> int:
        if isinstance(weight, bool) or not isinstance(weight, (int, float, np.integer,
                                                                np.floating)):
            raise AggregationError(f"{self.name}: {source}'s weight is {weight!r}")
        if not math.isfinite(weight) or weight < 0:
            raise AggregationError(f"{self.name}: {source}'s weight {weight} is negative, "
                                   f"NaN or inf")
        if weight != int(weight):
            raise RefusedError(
                f"{self.name}: {source}'s weight {weight:g} is not a whole number: a sum of "
                f"codes on a shared grid weighs each client by an integer (its examples, or "
                f"1), and {weight:g} * code is no integer. It would need the per-client "
                f"round (no [compression] clip_range), which folds each payload in fixed "
                f"point")
        return int(weight)

    def _fold(self, sums: Mapping[str, np.ndarray], mass: int, count: int, whole: Any,
              source: str) -> None:
        """Add checked integer sums (and the whole keys, which may still refuse first)."""
        if (self.mass + mass) * self.levels > _INT64_MAX:
            raise AggregationError(f"{self.name}: {source} takes the weights to "
                                   f"{self.mass + mass}, beyond what an int64 sum of "
                                   f"{self.levels}-level codes holds")
        if self.whole is not None:
            if isinstance(whole, FixedPartial):
                self.whole.merge(whole, source=source)
            else:
                self.whole.add(dict(whole or {}), float(mass), source=source)
        for key, part in sums.items():
            np.add(self.sums[key], part, out=self.sums[key])
        self.mass += mass
        self.count += count
        self.sources.append(source)


def _whole_number(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    return int(value)


def to_wire(sums: Mapping[str, np.ndarray], mass: int, count: int, levels: int,
            whole: FixedPartial | None) -> dict[str, Any]:
    """A grid sum's flat wire form (:meth:`CodeSum.to_wire`)."""
    bits = max(1, (mass * levels).bit_length())
    wire: dict[str, Any] = {"bits": bits, "mass": mass, "count": count, "levels": levels}
    for key, total in sums.items():
        wire[SIZE + key] = int(total.size)
        wire[SUM + key] = pack(total.astype(vector_dtype(bits)), bits)
    if whole is not None:
        wire.update({WHOLE + k: v for k, v in whole.to_wire().items()})
    return wire


def parse_wire(wire: Mapping[str, Any], source: str) -> tuple[
        int, int, int, dict[str, int], dict[str, np.ndarray], FixedPartial | None]:
    """A grid sum from elsewhere, checked (ProtocolError naming ``source``): its mass,
    count, levels, each key's coordinates and int64 sum, and the whole keys' partial."""
    try:
        bits, mass, count, levels = (_whole_number(wire.get(k), k)
                                     for k in ("bits", "mass", "count", "levels"))
        sizes = {k[len(SIZE):]: _whole_number(v, k) for k, v in wire.items()
                 if k.startswith(SIZE)}
    except ValueError as exc:
        raise ProtocolError(f"{source}: a grid sum's {exc}") from None
    most = mass * levels
    if count < 1 or not 1 <= bits <= 64 or levels < 1 or most.bit_length() > bits \
            or most > _INT64_MAX:
        raise ProtocolError(f"{source}: a grid sum of {count} codes of {levels} levels "
                            f"weighing {mass} at {bits} bits a coordinate does not fit (its "
                            f"codes reach {most}, {most.bit_length()} bits)")
    if {k[len(SUM):] for k in wire if k.startswith(SUM)} != set(sizes):
        raise ProtocolError(f"{source}: a grid sum's keys (sum/) and sizes (n/) differ")
    sums = {}
    for key, size in sizes.items():
        try:
            total = unpack(wire[SUM + key], bits, size)
        except ValueError as exc:
            raise ProtocolError(f"{source}: key {key!r}: {exc}") from None
        if size and int(total.max()) > most:
            raise ProtocolError(f"{source}: key {key!r} sums to more than its {count} "
                                f"codes weighing {mass} can ({most})")
        sums[key] = total.astype(np.int64)
    entries = {k[len(WHOLE):]: v for k, v in wire.items() if k.startswith(WHOLE)}
    partial = None
    if entries:
        try:
            partial = FixedPartial.from_wire(entries, what=f"{source}'s keys sent whole")
        except AggregationError as exc:
            raise ProtocolError(str(exc)) from None
    return mass, count, levels, sizes, sums, partial


class GridTotal:
    """Grid sums (:meth:`CodeSum.to_wire`) added exactly with neither the model nor the
    compressor: a host relay's sum of its ranks' sums. The first sum sets the keys, sizes
    and levels; one that differs, or does not fit, is refused (ProtocolError) and leaves
    the total as it was."""

    def __init__(self) -> None:
        self.levels = 0
        self.sizes: dict[str, int] = {}
        self.sums: dict[str, np.ndarray] = {}
        self.mass = self.count = 0
        self.whole: FixedPointSum | None = None

    def add(self, wire: Mapping[str, Any], *, source: str) -> None:
        mass, count, levels, sizes, sums, partial = parse_wire(wire, source)
        if self.count and (levels != self.levels or sizes != self.sizes
                           or (partial is None) != (self.whole is None)):
            raise ProtocolError(f"{source}: a grid sum of other keys, sizes or levels than "
                                f"the others' ({levels} levels, {sorted(sizes)[:4]})")
        if (self.mass + mass) * levels > _INT64_MAX:
            raise ProtocolError(f"{source}: takes the weights to {self.mass + mass}, beyond "
                                f"an int64 sum of {levels}-level codes")
        if partial is not None:
            whole = self.whole or FixedPointSum(partial.fraction_bits)
            try:
                whole.merge(partial, source=source)
            except AggregationError as exc:
                raise ProtocolError(str(exc)) from None
            self.whole = whole
        if not self.count:
            self.levels, self.sizes = levels, sizes
            self.sums = {k: np.zeros(n, np.int64) for k, n in sizes.items()}
        for key, part in sums.items():
            np.add(self.sums[key], part, out=self.sums[key])
        self.mass += mass
        self.count += count

    def to_wire(self) -> dict[str, Any]:
        whole = self.whole.partial() if self.whole is not None else None
        return to_wire(self.sums, self.mass, self.count, self.levels, whole)
