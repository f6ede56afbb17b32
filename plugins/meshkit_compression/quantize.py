"""``quantize``: unbiased stochastic uniform quantisation (Alistarh et al., *QSGD*, 2017).

Each chunk of ``chunk`` coordinates is mapped onto ``2**bits`` evenly
spaced levels between its own minimum ``lo`` and maximum (``step`` apart);
a coordinate ``x`` at ``t = (x - lo) / step`` levels rounds up with
probability ``t - floor(t)``, else down, so E[decoded] = x exactly (with
the float32 ``lo`` and ``step`` that travel). Codes are packed ``8 / bits``
to a byte. Cost per coordinate: ``bits + 64 / chunk`` bits.

Under secure aggregation (the trait ``integer_field``) a chunk's own range
cannot be used: the coordinator decodes only the *sum* of every client's
codes, so all clients share one grid, the round's public
``[-clip_range, clip_range]`` in ``2**bits - 1`` steps of
``2 clip_range / (2**bits - 1)``. A coordinate is clipped to that range,
then rounded up or down at random as above (unbiased within the range);
``n`` clients' codes sum to at most ``n (2**bits - 1)``, exact in a field
of ``bits + ceil(log2 n)`` bits, and decode as ``sum * step - n * clip_range``.
"""

from __future__ import annotations

from typing import Iterator, Mapping

import numpy as np

from meshkit.compression import CompressionTraits

__all__ = ["Quantize"]


class Quantize:
    """Stochastic uniform quantisation to ``bits`` (8, 4, 2) per coordinate."""

    traits = CompressionTraits(unbiased=True, sparse=False, integer_field=True,
                               stateful=False, contractive=False)

    def __init__(self, *, bits: int = 8, chunk: int = 1024) -> None:
        self.bits, self.chunk = int(bits), int(chunk)
        self.levels = (1 << self.bits) - 1
        #: Under secure aggregation each code is below 2**field_bits (module docstring).
        self.field_bits = self.bits

    def _chunks(self, size: int) -> int:
        return -(-size // self.chunk)

    def bounds(self, size: int) -> dict[str, tuple[np.dtype, int]]:
        chunks = self._chunks(size)
        return {"codes": (np.dtype(np.uint8), -(-size * self.bits // 8)),
                "lo": (np.dtype(np.float32), chunks), "step": (np.dtype(np.float32), chunks)}

    def encode(self, x: np.ndarray, *, seed: int) -> dict[str, np.ndarray]:
        size = x.size
        chunks = self._chunks(size)
        padded = np.zeros(chunks * self.chunk, np.float32)
        padded[:size] = x
        blocks = padded.reshape(chunks, self.chunk)
        # The tail chunk's padding must not widen its range.
        last = size - (chunks - 1) * self.chunk
        lo = blocks.min(axis=1)
        hi = blocks.max(axis=1)
        lo[-1], hi[-1] = x[-last:].min(), x[-last:].max()
        step = ((hi.astype(np.float64) - lo) / self.levels).astype(np.float32)
        safe = np.where(step > 0, step, 1.0).astype(np.float64)
        t = (blocks - lo[:, None].astype(np.float64)) / safe[:, None]
        floor = np.floor(t)
        rng = np.random.default_rng(seed)
        codes = floor + (rng.random(t.shape) < (t - floor))
        codes = np.clip(codes, 0, self.levels).astype(np.uint8).ravel()[:size]
        return {"codes": _pack(codes, self.bits), "lo": lo, "step": step}

    def _checked(self, fields: Mapping[str, np.ndarray], size: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        chunks = self._chunks(size)
        codes, lo, step = fields["codes"], fields["lo"], fields["step"]
        if codes.size != -(-size * self.bits // 8) or lo.size != chunks or step.size != chunks:
            raise ValueError(f"{codes.size} code bytes and {lo.size}/{step.size} scales for "
                             f"{size} coordinates of {self.bits} bits in chunks of "
                             f"{self.chunk}")
        if not (np.isfinite(lo).all() and np.isfinite(step).all()):
            raise ValueError("a chunk's scale is not finite")
        return codes, lo, step

    def decode(self, fields: Mapping[str, np.ndarray], size: int) -> np.ndarray:
        codes, lo, step = self._checked(fields, size)
        values = _unpack(codes, self.bits, size).astype(np.float64)
        per = np.repeat(np.arange(self._chunks(size)), self.chunk)[:size]
        return (lo[per].astype(np.float64) + values * step[per]).astype(np.float32)

    def decode_chunks(self, fields: Mapping[str, np.ndarray], size: int,
                      step: int) -> Iterator[tuple[int, np.ndarray]]:
        """:meth:`decode`'s vector ``step`` coordinates at a time, the same bits: each
        range's codes unpacked and scaled on their own (no whole float copy)."""
        codes, lo, scale = self._checked(fields, size)
        per_byte = 8 // self.bits
        for start in range(0, size, step):
            stop = min(size, start + step)
            first = start // per_byte
            packed = codes[first:-(-stop // per_byte)]
            skip = start - first * per_byte
            values = _unpack(packed, self.bits, skip + stop - start)[skip:].astype(np.float64)
            per = np.arange(start, stop) // self.chunk
            yield start, (lo[per].astype(np.float64) + values * scale[per]).astype(np.float32)


    def encode_field(self, x: np.ndarray, *, seed: int, clip_range: float) -> np.ndarray:
        """``x`` on the round's shared grid (module docstring): uint32 codes, one each."""
        c = float(clip_range)
        t = np.clip(np.asarray(x, np.float64).ravel(), -c, c)
        t += c
        t *= self.levels / (2.0 * c)
        floor = np.floor(t)
        t -= floor
        rng = np.random.default_rng(seed)
        floor += rng.random(t.shape) < t
        # A coordinate at the top of the range has t == levels exactly; round-off only
        # could push a code past it.
        np.clip(floor, 0, self.levels, out=floor)
        return floor.astype(np.uint32)

    def decode_field(self, total: np.ndarray, *, clip_range: float,
                     count: int) -> np.ndarray:
        """The sum of ``count`` clients' updates whose codes sum to ``total``."""
        c = float(clip_range)
        out = np.asarray(total).astype(np.float64)
        out *= 2.0 * c / self.levels
        out -= count * c
        return out


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        return codes
    per = 8 // bits
    padded = np.zeros(-(-codes.size // per) * per, np.uint8)
    padded[:codes.size] = codes
    lanes = padded.reshape(-1, per)
    out = np.zeros(lanes.shape[0], np.uint8)
    for lane in range(per):
        out |= (lanes[:, lane] << (lane * bits)).astype(np.uint8)
    return out


def _unpack(packed: np.ndarray, bits: int, size: int) -> np.ndarray:
    if bits == 8:
        return packed[:size]
    per = 8 // bits
    mask = (1 << bits) - 1
    lanes = np.stack([(packed >> (lane * bits)) & mask for lane in range(per)], axis=1)
    return lanes.ravel()[:size]
