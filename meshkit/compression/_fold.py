"""Compressed contributions summed exactly, a chunk at a time: :class:`CompressedSum`.

Rule: a linear fold never decodes a compressed contribution into a float copy
of the model. For each compressed key the coordinator decodes ``step``
coordinates at a time into scratch (the compressor's optional
``decode_chunks``, :class:`~meshkit.compression.Compressor`), rebuilds them
as the model's values (the reference plus the update, in float64, rounded
to the model's dtype: what :func:`decode_contribution` gives), and adds
them, weighted, into an int64 fixed-point accumulator -- the arithmetic of
:class:`~meshkit.aggregation.FixedPointSum`, element for element, so the
result is ``FixedPointSum``'s over the decoded contributions bit for bit,
and does not depend on the order contributions arrive in. What it holds is
the accumulators (8 bytes a coordinate, as any exact sum) and one chunk of
scratch; the keys sent whole (:func:`compressed_keys`: integers, JSON,
buffers, local keys) go through a ``FixedPointSum`` of their own.

A compressor without ``decode_chunks`` is decoded whole, one key at a time
(one float32 copy of that key).

A contribution refused -- a payload that does not fit the compressor's
bounds or does not decode (:class:`~meshkit.ProtocolError`), a value that is
NaN, inf or beyond the sum's range (:class:`~meshkit.AggregationError`,
:class:`~meshkit.aggregation.ContributionOutOfRange`) -- leaves the sum as it
was: the chunks already added are decoded again and subtracted (integers:
exactly).
"""

from __future__ import annotations

import math
from typing import Any, Collection, Iterator, Mapping

import numpy as np

from meshkit.aggregation import (DEFAULT_FRACTION_BITS, ContributionOutOfRange, FixedPointSum,
                                 check_weight)
from meshkit.compression._contract import Compressor
from meshkit.compression._payload import checked_payload, compressed_keys, decoded
from meshkit.errors import AggregationError, ProtocolError

__all__ = ["CompressedSum", "decoded_chunks", "DECODE_STEP"]

#: Coordinates decoded and added at a time (16 Ki: well under a MiB of scratch).
DECODE_STEP = 1 << 14
_INT64_MAX = (1 << 63) - 1


def decoded_chunks(compressor: Compressor, fields: Mapping[str, np.ndarray], size: int,
                   key: str, step: int = DECODE_STEP) -> Iterator[tuple[int, np.ndarray]]:
    """``key``'s decoded update as (start, float32 chunk), in order, covering ``size``:
    the compressor's ``decode_chunks`` when it has one (each chunk checked), else its
    whole ``decode``. A chunk that does not fit is a ProtocolError; ``ValueError``
    (a payload that does not decode) passes through."""
    chunks = getattr(compressor, "decode_chunks", None)
    if chunks is None:
        whole = decoded(compressor, fields, size, key)
        for start in range(0, size, step):
            yield start, whole[start:start + step]
        return
    at = 0
    for start, part in chunks(fields, size, step):
        if start != at or not isinstance(part, np.ndarray) or part.ndim != 1 \
                or not 0 < part.size <= size - at:
            raise ProtocolError(f"the compressor's decode_chunks gave key {key!r} a chunk "
                                f"at {start} of {getattr(part, 'shape', type(part).__name__)}; "
                                f"the next starts at {at} and {size - at} are left")
        at += part.size
        yield start, part.astype(np.float32, copy=False)
    if at != size:
        raise ProtocolError(f"the compressor's decode_chunks gave key {key!r} {at} of "
                            f"{size} coordinates")


def refuse_empty(name: str, count: int, mass: int) -> None:
    """The AggregationError an exact sum's mean raises when it has nothing to divide:
    no contributions (``count``), or weights (``mass``) that sum to zero."""
    if not count:
        raise AggregationError(f"{name}: no contributions to aggregate; a round "
                               f"needs at least one contributor")
    if mass <= 0:
        raise AggregationError(f"{name}: the weights sum to zero over {count} contributions")


class CompressedSum:
    """The exact weighted mean of compressed contributions against ``reference`` (the
    round's model), folded a chunk at a time (module docstring).

    :meth:`add` takes a payload (the ``fit`` reply's layout, :mod:`._payload`) and gives
    back its residuals (error feedback); :meth:`result` is the mean, each array in the
    model's dtype.
    """

    def __init__(self, compressor: Compressor, reference: Mapping[str, Any], *,
                 raw: Collection[str] = (), fraction_bits: int = DEFAULT_FRACTION_BITS,
                 name: str = "fedavg", step: int = DECODE_STEP,
                 residuals: bool = True) -> None:
        self.compressor, self.reference, self.raw = compressor, reference, tuple(raw)
        #: Whether a stateful compressor's payloads carry residuals (False: its workers
        #: keep them, ``[compression] residual = "worker"``).
        self.residuals = residuals
        self.name, self.step = name, max(1, int(step))
        self.fraction_bits = fraction_bits
        self.one = float(2 ** fraction_bits)
        self.keys = compressed_keys(reference, self.raw)
        #: The keys that travel whole, summed by a FixedPointSum of their own.
        self.whole_keys = [k for k in reference if k not in set(self.keys)]
        self.whole = FixedPointSum(fraction_bits, name=name) if self.whole_keys else None
        self.sums = {k: np.zeros(int(np.asarray(reference[k]).size), np.int64)
                     for k in self.keys}
        self.bounds = dict.fromkeys(self.keys, 0)
        self.mass = 0  # the sum of round(weight * 2**fraction_bits)
        self.sources: list[str] = []
        n = min(self.step, max((s.size for s in self.sums.values()), default=1)) or 1
        self._wide = np.empty(n, np.float64)
        self._ints = np.empty(n, np.int64)

    @property
    def count(self) -> int:
        return len(self.sources)

    def check(self, payload: Mapping[str, Any], *, what: str) -> None:
        """A ProtocolError unless ``payload`` fits the compressor's bounds key by key (the
        check :meth:`add` starts with; nothing is decoded), so a round can refuse a payload
        as it arrives rather than when its turn to be folded comes."""
        checked_payload(self.compressor, payload, self.reference, raw=self.raw, what=what,
                        residuals=self.residuals)

    def add(self, payload: Mapping[str, Any], weight: float, *,
            source: str) -> dict[str, np.ndarray]:
        """Fold ``payload`` with ``weight``; its residuals. A refusal changes nothing."""
        w = check_weight(weight, source, name=self.name)
        scale = w * self.one
        fields_of, residuals = checked_payload(self.compressor, payload, self.reference,
                                               raw=self.raw, what=source,
                                               residuals=self.residuals)
        done: list[tuple[str, int]] = []  # (key, chunks added)
        bounds = dict(self.bounds)
        try:
            for key in self.keys:
                done.append((key, 0))
                for i, _ in enumerate(self._fold_key(key, fields_of[key], scale, w, source)):
                    done[-1] = (key, i + 1)
            if self.whole is not None:
                self.whole.add({k: payload[k] for k in self.whole_keys}, w, source=source)
        except (AggregationError, ProtocolError):
            self._undo(done, fields_of, scale)
            self.bounds = bounds
            raise
        except ValueError as exc:  # the compressor's: the payload does not decode
            self._undo(done, fields_of, scale)
            self.bounds = bounds
            raise ProtocolError(f"{source}: a key does not decode: {exc}") from None
        self.mass += round(scale)
        self.sources.append(source)
        return residuals

    def result(self) -> dict[str, Any]:
        """The weighted mean: ``FixedPointSum.result()``'s over the decoded contributions."""
        refuse_empty(self.name, self.count, self.mass)
        rest = self.whole.result() if self.whole is not None else {}
        mass = float(self.mass)
        out: dict[str, Any] = {}
        for key, ref in self.reference.items():
            if key not in self.sums:
                out[key] = rest[key]
                continue
            sums = self.sums.pop(key)
            mean = np.empty(sums.size, np.asarray(ref).dtype)
            for start in range(0, sums.size, self.step):
                t = self._wide[:min(self.step, sums.size - start)]
                np.copyto(t, sums[start:start + t.size], casting="unsafe")
                np.divide(t, mass, out=t)
                np.copyto(mean[start:start + t.size], t, casting="unsafe")
            out[key] = mean.reshape(np.shape(ref))
        return out

    # -- internals ----------------------------------------------------------------------

    def _values(self, key: str, start: int, part: np.ndarray) -> np.ndarray:
        """The model's values at ``key[start:]`` for decoded ``part``, in float64 scratch:
        (reference + update) rounded to the model's dtype, as decode_contribution gives."""
        ref = np.asarray(self.reference[key]).reshape(-1)
        t = self._wide[:part.size]
        np.copyto(t, ref[start:start + part.size], casting="unsafe")
        np.add(t, part, out=t)
        if ref.dtype != np.float64:
            np.copyto(t, t.astype(ref.dtype), casting="unsafe")
        return t

    def _fold_key(self, key: str, fields: Mapping[str, np.ndarray], scale: float, w: float,
                  source: str) -> Iterator[None]:
        """Add ``key``'s chunks one by one (a generator: the caller counts what was added)."""
        acc, biggest = self.sums[key], 0.0
        for start, part in decoded_chunks(self.compressor, fields, acc.size, key, self.step):
            t = self._values(key, start, part)
            hi, lo = float(t.max()), float(t.min())
            if not (math.isfinite(hi) and math.isfinite(lo)):
                raise AggregationError(f"{self.name}: aggregating {key!r}: {source} decodes "
                                       f"to NaN or inf; non-finite values are refused")
            biggest = max(biggest, hi, -lo)
            term = round(biggest * scale) if math.isfinite(biggest * scale) else math.inf
            if term > _INT64_MAX or self.bounds[key] + term > _INT64_MAX:
                raise ContributionOutOfRange(
                    f"{self.name}: aggregating {key!r}: a weighted value from {source} "
                    f"(weight {w:g}) is beyond the range of a {self.fraction_bits}-bit "
                    f"fixed-point sum; scale the weights down or lower fraction_bits")
            self._accumulate(acc, start, t, scale, 1)
            yield None
        self.bounds[key] += round(biggest * scale)

    def _accumulate(self, acc: np.ndarray, start: int, t: np.ndarray, scale: float,
                    sign: int) -> None:
        np.multiply(t, scale, out=t)
        np.rint(t, out=t)
        ints = self._ints[:t.size]
        np.copyto(ints, t, casting="unsafe")
        a = acc[start:start + t.size]
        if sign > 0:
            np.add(a, ints, out=a)
        else:
            np.subtract(a, ints, out=a)

    def _undo(self, done: list[tuple[str, int]], fields_of: Mapping[str, Any],
              scale: float) -> None:
        """Take back the chunks a refused contribution added (decoded again: the same ints)."""
        for key, added in done:
            if not added:
                continue
            acc = self.sums[key]
            chunks = decoded_chunks(self.compressor, fields_of[key], acc.size, key, self.step)
            for _, (start, part) in zip(range(added), chunks):
                self._accumulate(acc, start, self._values(key, start, part), scale, -1)
