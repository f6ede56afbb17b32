"""Outer gradients in 8 or 4 bits: blockwise symmetric quantisation whose decoding is exact.

Rule: a float array is flattened (C order) and cut into blocks of
:data:`BLOCK` elements. Each block's scale is its largest ``|x|`` divided by
``L = 2**(bits-1) - 1`` (127 at 8 bits, 7 at 4 bits), kept as a float32; a
value's code is ``rint(x / scale)`` clipped to ``[-L, L]`` (0 for a block of
zeros). 8-bit codes travel as int8, 4-bit ones packed two a byte (the even
element in the low nibble, each as ``code + 8``). ``bits = 32`` sends the
float32 values themselves (no scales).

Decoding is ``float32(code) * scale`` in float32: a pure function of the
bytes, so every replica that decodes the same message gets the same bits --
what lets DiLoCo's replicas apply one outer step identically. The error of
a value is at most half a step, ``scale / 2`` (``max|x| / 254`` of its block
at 8 bits, ``max|x| / 14`` at 4 bits). A block's scale costs 4 bytes per
:data:`BLOCK` elements (1.6 %).

Nothing here trusts the wire: :func:`decode_blocks` checks each array's
dtype and length against the shape the receiver already knows before it
decodes.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from meshkit.errors import ProtocolError

__all__ = ["BLOCK", "OUTER_BITS", "encode_blocks", "decode_blocks", "encoded_bytes",
           "GridSum", "mean_of_sum", "on_grid", "sum_dtype"]

#: Elements per block (one float32 scale each).
BLOCK = 256
#: The widths a code may have (32: no quantisation).
OUTER_BITS = (32, 8, 4)


def _levels(bits: int) -> int:
    if bits not in (8, 4):
        raise ValueError(f"bits must be one of {OUTER_BITS}, got {bits}")
    return (1 << (bits - 1)) - 1


def encode_blocks(values: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, scales)`` of a float array (``scales`` empty at 32 bits: codes are float32)."""
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    if bits == 32:
        return flat.copy(), np.zeros(0, dtype=np.float32)
    levels = _levels(bits)
    blocks = -(-flat.size // BLOCK)
    padded = np.zeros(blocks * BLOCK, dtype=np.float32)
    padded[:flat.size] = flat
    grid = padded.reshape(blocks, BLOCK)
    scales = (np.abs(grid).max(axis=1) / np.float32(levels)).astype(np.float32)
    inverse = np.zeros_like(scales)
    np.divide(np.float32(1.0), scales, out=inverse, where=scales > 0)
    codes = np.rint(grid * inverse[:, None]).clip(-levels, levels).astype(np.int8)
    codes = codes.reshape(-1)[:flat.size]
    if bits == 8:
        return codes, scales
    nibbles = (codes.astype(np.int16) + 8).astype(np.uint8)
    if nibbles.size % 2:
        nibbles = np.append(nibbles, np.uint8(8))
    return (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8), scales


def decode_blocks(codes: Any, scales: Any, size: int, bits: int, *,
                  what: str = "an outer gradient") -> np.ndarray:
    """The float32 values (flat, ``size`` of them) that ``codes`` and ``scales`` encode.

    A :class:`~meshkit.ProtocolError` names ``what`` when a dtype or a length
    does not fit ``size`` and ``bits``: checked before anything is decoded.
    """
    expected = {32: (np.float32, size), 8: (np.int8, size), 4: (np.uint8, (size + 1) // 2)}
    if bits not in expected:
        raise ProtocolError(f"{what}: bits must be one of {OUTER_BITS}, got {bits}")
    dtype, length = expected[bits]
    blocks = 0 if bits == 32 else -(-size // BLOCK)
    for name, array, want_dtype, want in (("codes", codes, dtype, length),
                                           ("scales", scales, np.float32, blocks)):
        if not isinstance(array, np.ndarray) or array.dtype != np.dtype(want_dtype) \
                or array.ndim != 1 or array.size != want:
            found = (f"{array.dtype}[{array.size}]" if isinstance(array, np.ndarray)
                     else type(array).__name__)
            raise ProtocolError(f"{what}: {name} must be {np.dtype(want_dtype)}[{want}] for "
                                f"{size} values at {bits} bits, got {found}")
    if bits == 32:
        if not np.isfinite(codes).all():
            raise ProtocolError(f"{what}: holds NaN or inf")
        return codes.astype(np.float32, copy=True)
    if not np.isfinite(scales).all() or (scales < 0).any():
        raise ProtocolError(f"{what}: a block scale is negative, NaN or inf")
    if bits == 8:
        small = codes.astype(np.float32)
    else:
        pairs = np.empty(codes.size * 2, dtype=np.int16)
        pairs[0::2] = codes & 0x0F
        pairs[1::2] = codes >> 4
        small = (pairs[:size] - 8).astype(np.float32)
    levels = _levels(bits)
    if np.abs(small).max(initial=0) > levels:
        raise ProtocolError(f"{what}: a code is outside [-{levels}, {levels}]")
    return small * np.repeat(scales, BLOCK)[:size]


def encoded_bytes(codes: Mapping[str, np.ndarray], scales: Mapping[str, np.ndarray]) -> int:
    """The payload bytes of an encoded state (codes and scales; framing not counted)."""
    return sum(int(a.nbytes) for a in codes.values()) + sum(int(a.nbytes)
                                                            for a in scales.values())


# -- the exact mean of several replicas' codes: on one grid, summed as integers ---------
#
# Each replica's codes sit on its own block scales, so their sum is no integer sum. The
# mean DiLoCo's exchange applies (the star's fold and the ring's sum alike) is:
#
# 1. the shared scale of a block: the largest of the replicas' scales for it (a max,
#    exact in any order);
# 2. each replica's decoded values re-coded on the shared scales (``rint(v / S)``,
#    clipped to [-L, L], so they fit ``bits`` again: |v| <= L s <= L S);
# 3. those codes summed as integers in :func:`sum_dtype` -- exact, the same bits in any
#    order, over any grouping (star, ring);
# 4. the mean: ``float32(sum) * S / float32(count)``, in float32.
#
# Re-coding adds at most half a shared step to each value's error (so at most
# ``s / 2 + S / 2`` against the value the replica encoded).


def sum_dtype(bits: int, count: int) -> np.dtype:
    """The narrowest signed integer dtype that holds the sum of ``count`` codes of ``bits``
    bits (|code| <= L): bits + ceil(log2 count) bits, rounded up to a numpy width --
    int8 for 4-bit codes of up to 18 replicas, int16 for 8-bit codes of up to 258."""
    largest = _levels(bits) * max(int(count), 1)
    for dtype in (np.int8, np.int16, np.int32, np.int64):
        if largest <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise ValueError(f"{count} replicas' {bits}-bit codes do not fit an int64 sum")


def on_grid(values: np.ndarray, shared: np.ndarray, bits: int) -> np.ndarray:
    """Decoded ``values`` (flat float32) re-coded on the ``shared`` block scales (int8)."""
    levels = _levels(bits)
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    shared = np.asarray(shared, dtype=np.float32)
    if shared.size != -(-flat.size // BLOCK):
        raise ValueError(f"{shared.size} shared scales for {flat.size} values at block "
                         f"{BLOCK}")
    inverse = np.zeros_like(shared)
    np.divide(np.float32(1.0), shared, out=inverse, where=shared > 0)
    scaled = flat * np.repeat(inverse, BLOCK)[:flat.size]
    return np.rint(scaled).clip(-levels, levels).astype(np.int8)


def mean_of_sum(total: np.ndarray, shared: np.ndarray, count: int) -> np.ndarray:
    """The float32 mean of ``count`` replicas whose codes on ``shared`` summed to ``total``."""
    flat = np.asarray(total).reshape(-1)
    step = np.repeat(np.asarray(shared, dtype=np.float32), BLOCK)[:flat.size]
    return flat.astype(np.float32) * step / np.float32(count)


class GridSum:
    """The star's side of the exact mean above: each replica's decoded values and own
    scales per key go in (:meth:`add`); :meth:`result` is the same float32 mean the ring's
    replicas compute (:func:`on_grid`, :func:`sum_dtype`, :func:`mean_of_sum`)."""

    def __init__(self, bits: int) -> None:
        _levels(bits)
        self.bits = bits
        self._values: list[Mapping[str, np.ndarray]] = []
        self._scales: list[Mapping[str, np.ndarray]] = []

    @property
    def count(self) -> int:
        return len(self._values)

    def add(self, values: Mapping[str, np.ndarray], scales: Mapping[str, np.ndarray]) -> None:
        self._values.append(values)
        self._scales.append(scales)

    def totals(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Per key, the shared scales and the integer sum of the codes on them."""
        if not self._values:
            raise ValueError("no replica's values to sum")
        dtype = sum_dtype(self.bits, self.count)
        shared: dict[str, np.ndarray] = {}
        totals: dict[str, np.ndarray] = {}
        for key in self._values[0]:
            shared[key] = np.maximum.reduce([np.asarray(s[key], np.float32)
                                             for s in self._scales])
            total = np.zeros(np.size(self._values[0][key]), dtype)
            for values in self._values:
                np.add(total, on_grid(values[key], shared[key], self.bits), out=total,
                       casting="unsafe")
            totals[key] = total
        return shared, totals

    def result(self) -> dict[str, np.ndarray]:
        shared, totals = self.totals()
        return {key: mean_of_sum(totals[key], shared[key], self.count).reshape(
            np.shape(self._values[0][key])) for key in totals}
