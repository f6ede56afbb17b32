"""How ``top-k``'s kept coordinates are laid out: indices as uint32 or as uint8 gaps, values
as float32 or quantised to 8 or 4 bits with one float32 scale a key.

Rule: every byte of a sparse payload is laid out here, and checked here before anything
is allocated from it (:func:`entries`).

*Indices* (``index``):

* ``"u32"``: the ``k`` kept indices, ascending, as uint32 (32 bits an entry);
* ``"gap8"``: the gaps between them as uint8 (8 bits an entry): entry ``i`` sits at
  ``gap[0] + ... + gap[i] - 1`` (the first gap counts from -1, so every gap is at least
  1). A gap over 255 is bridged by *filler* entries of gap 255 and value 0 -- at most
  ``(n - k) // 255`` of them in a key of ``n`` coordinates, so a payload has at most
  ``k + n // 255`` entries. A filler writes a zero where nothing was kept: the decoded
  vector is the same.

*Values* (``value_bits``):

* ``32``: float32, exact (``value``);
* ``8`` / ``4``: a symmetric code in ``[-L, L]`` (``L`` = 127 or 7) times one float32
  ``scale`` a key (``max |kept value| / L``); 8-bit codes as int8 (``code``), 4-bit codes
  two a byte (low nibble first, two's complement; an odd count pads with a zero nibble).
  Rounded to the nearest code (deterministic: under error feedback the residual takes the
  rounding error) or, with ``stochastic``, up or down at random with the probability that
  makes each value's expectation exact.

What is checked on the coordinator (a hostile worker's payload): each field's length
against the entries it must match, every gap at least 1 and their sum at most ``n``
(so every position is distinct, ascending and in range), uint32 indices ascending,
distinct and below ``n``, every code within ``[-L, L]``, the scale finite, not negative
and small enough that ``L * scale`` is a finite float32, every float32 value finite.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

__all__ = ["INDEX", "VALUE_BITS", "LEVELS", "most_entries", "bounds", "lay_out", "entries"]

#: The index layouts.
INDEX = ("u32", "gap8")
#: The value widths.
VALUE_BITS = (32, 8, 4)
#: The largest code magnitude of each quantised width.
LEVELS = {8: 127, 4: 7}
#: A gap's largest value (a longer gap is bridged by fillers).
GAP_MAX = 255
_F32_MAX = float(np.finfo(np.float32).max)


def most_entries(index: str, k: int, size: int) -> int:
    """The most entries a payload of ``k`` kept coordinates of ``size`` may hold."""
    return k if index == "u32" else k + size // GAP_MAX


def _code_bytes(value_bits: int, entries: int) -> int:
    return entries if value_bits == 8 else -(-entries // 2)


def bounds(index: str, value_bits: int, k: int, size: int) -> dict[str, tuple[np.dtype, int]]:
    """Each field's dtype and most elements."""
    m = most_entries(index, k, size)
    out: dict[str, tuple[np.dtype, int]] = (
        {"index": (np.dtype(np.uint32), m)} if index == "u32"
        else {"gap": (np.dtype(np.uint8), m)})
    if value_bits == 32:
        out["value"] = (np.dtype(np.float32), m)
    else:
        out["code"] = (np.dtype(np.int8 if value_bits == 8 else np.uint8),
                       _code_bytes(value_bits, m))
        out["scale"] = (np.dtype(np.float32), 1)
    return out


def lay_out(position: np.ndarray, value: np.ndarray, *, index: str, value_bits: int,
            seed: int, stochastic: bool) -> dict[str, np.ndarray]:
    """The fields of the kept coordinates at ``position`` (ascending int64) holding
    ``value`` (float32)."""
    if index == "u32":
        fields = {"index": position.astype(np.uint32)}
    else:
        gap, value = _gaps(position, value)
        fields = {"gap": gap}
    if value_bits == 32:
        fields["value"] = value.astype(np.float32)
    else:
        fields.update(_quantised(value, value_bits, seed, stochastic))
    return fields


def _gaps(position: np.ndarray, value: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the uint8 gaps, the values with a zero at each filler): vectorised, no loop."""
    gap = np.diff(position, prepend=-1)  # each >= 1: the positions are distinct
    fillers = (gap - 1) // GAP_MAX
    ends = np.cumsum(fillers + 1) - 1  # where each kept coordinate's own entry lands
    total = int(ends[-1]) + 1 if ends.size else 0
    out = np.full(total, GAP_MAX, np.uint8)
    out[ends] = (gap - GAP_MAX * fillers).astype(np.uint8)
    spread = np.zeros(total, np.float32)
    spread[ends] = value
    return out, spread


def _quantised(value: np.ndarray, bits: int, seed: int,
               stochastic: bool) -> dict[str, np.ndarray]:
    levels = LEVELS[bits]
    wide = value.astype(np.float64)
    top = float(np.abs(wide).max()) if wide.size else 0.0
    scale = np.float32(top / levels)
    if scale > 0 and np.isfinite(scale):
        t = wide / float(scale)
        if stochastic:  # unbiased: E[code] = t
            low = np.floor(t)
            t = low + (np.random.default_rng(seed).random(t.size) < t - low)
        else:
            t = np.rint(t)
        code = np.clip(t, -levels, levels).astype(np.int8)
    else:  # nothing to scale (all zero), or a non-finite value the decoder will refuse
        code = np.zeros(value.size, np.int8)
    if bits == 4:
        nibbles = np.zeros(_code_bytes(4, code.size) * 2, np.uint8)
        nibbles[:code.size] = code.view(np.uint8) & 0x0F
        code = (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8)
    return {"code": code, "scale": np.array([scale], np.float32)}


def entries(fields: Mapping[str, np.ndarray], *, index: str, value_bits: int, k: int,
            size: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions: ascending distinct int64 below ``size``, values: finite float32) of a
    payload, checked (module docstring) -- or a ``ValueError`` saying what is wrong."""
    most = most_entries(index, k, size)
    if index == "u32":
        raw = fields["index"]
        if raw.size != k:
            raise ValueError(f"{raw.size} indices; top-k of {size} coordinates sends {k}")
        position = raw.astype(np.int64)
        if k and (int(position[-1]) >= size or (np.diff(position) <= 0).any()):
            raise ValueError(f"the indices must be ascending, distinct and below {size}")
    else:
        gap = fields["gap"]
        if not k <= gap.size <= most:
            raise ValueError(f"{gap.size} gaps; top-k of {size} coordinates sends {k} and at "
                             f"most {most - k} fillers")
        if gap.size and int(gap.min()) < 1:
            raise ValueError("a gap is 0: the positions must be distinct")
        position = np.cumsum(gap, dtype=np.int64) - 1
        if gap.size and int(position[-1]) >= size:
            raise ValueError(f"the gaps sum to {int(position[-1]) + 1}, past the key's "
                             f"{size} coordinates")
    count = position.size
    if value_bits == 32:
        value = fields["value"]
        if value.size != count:
            raise ValueError(f"{value.size} values for {count} entries")
        if not np.isfinite(value).all():
            raise ValueError("a value is not finite")
        return position, value
    return position, _dequantised(fields, value_bits, count)


def _dequantised(fields: Mapping[str, np.ndarray], bits: int, count: int) -> np.ndarray:
    levels = LEVELS[bits]
    code, scale = fields["code"], fields["scale"]
    if scale.size != 1:
        raise ValueError(f"{scale.size} scales; a key sends 1")
    s = float(scale[0])
    if not 0.0 <= s <= _F32_MAX / levels:  # NaN fails too
        raise ValueError(f"the scale {s!r} is not a finite float32 from 0 whose {levels} "
                         f"levels stay finite")
    if code.size != _code_bytes(bits, count):
        raise ValueError(f"{code.size} code bytes for {count} entries of {bits} bits")
    if bits == 4:
        nibbles = np.empty(code.size * 2, np.uint8)
        nibbles[0::2], nibbles[1::2] = code & 0x0F, code >> 4
        if count % 2 and nibbles[-1]:
            raise ValueError("the padding nibble after the last 4-bit code is not 0")
        signed = nibbles[:count].astype(np.int8)
        signed[signed > 7] -= 16
    else:
        signed = code
    if count and int(np.abs(signed.astype(np.int16)).max()) > levels:
        raise ValueError(f"a code is beyond ±{levels}")
    return signed.astype(np.float32) * np.float32(s)
