"""Options (the ``[compression]`` keys) of the built-in compressors: attrs only."""

from __future__ import annotations

import math
from typing import Any

import attrs

__all__ = ["QuantizeOptions", "TopKOptions", "BITS"]

#: The code widths ``quantize`` packs (whole codes per byte).
BITS = (8, 4, 2)


def _bits(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or value not in BITS:
        raise ValueError(f"bits must be one of 8, 4 or 2, got {value!r}")


def _chunk(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not 16 <= value <= 2 ** 20:
        raise ValueError(f"chunk must be from 16 to 1048576 elements (each chunk carries its "
                         f"own 8 bytes of scale), got {value!r}")


def _fraction(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    if not (math.isfinite(value) and 0.0 < value <= 1.0):
        raise ValueError(f"fraction must be in (0, 1] (the share of each key's coordinates "
                         f"sent), got {value!r}")


def _value_bits(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or value not in (32, 8, 4):
        raise ValueError(f"value_bits must be 32, 8 or 4, got {value!r}")


@attrs.frozen
class QuantizeOptions:
    """``quantize``: unbiased stochastic uniform quantisation."""

    #: Bits per coordinate: 8, 4 or 2.
    bits: int = attrs.field(default=8, validator=_bits)
    #: Coordinates sharing one scale (min and step, 8 bytes).
    chunk: int = attrs.field(default=1024, validator=_chunk)
    #: Apply a randomised Hadamard rotation first (spreads outliers over the chunk).
    rotate: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))


@attrs.frozen
class TopKOptions:
    """``top-k``: the largest-magnitude coordinates of each key, with error feedback."""

    #: The share of each key's coordinates sent (at least one).
    fraction: float = attrs.field(default=0.01, converter=float, validator=_fraction)
    #: Add what compression left out to the client's next update (Stich et al. 2018).
    error_feedback: bool = attrs.field(default=True,
                                       validator=attrs.validators.instance_of(bool))
    #: Apply a randomised Hadamard rotation first.
    rotate: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    #: Bits a kept value travels in: 32 (float32), or 8 or 4 (a code times one float32
    #: scale a key; rounded to nearest under error feedback, at random without).
    value_bits: int = attrs.field(default=32, validator=_value_bits)
    #: How the kept indices travel: "u32" (uint32 each) or "gap8" (the gaps between
    #: them as uint8, fillers bridging a gap over 255).
    index: str = attrs.field(default="u32", validator=attrs.validators.in_(("u32", "gap8")))
