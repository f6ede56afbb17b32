"""The compression contract: what a compressor declares (:class:`CompressionTraits`) and does.

A *compressor* (kind ``compression``, hook ``meshkit_compression()``, table
``[compression]``) shrinks what a worker uploads: the update of one model
key (the fitted array minus the array the fit started from), flattened to
a float32 vector. :meth:`Compressor.encode` runs on the worker and returns
a few named arrays (its *fields*); :meth:`Compressor.decode` runs on the
coordinator and gives the vector back (exactly, or as an unbiased or
contractive estimate). :meth:`Compressor.bounds` says, for a vector of
``size`` elements, each field's dtype and most elements, so the kernel
checks a received payload before any decoder allocates
(:mod:`meshkit.compression._payload`).

The kernel composes compression with the rest of a run by these traits
only, never by a compressor's name (docs/compression.md):

* ``unbiased``: E[decode(encode(x))] = x over the encoder's seed;
* ``sparse``: the payload names coordinates (indices) -- refused under
  secure aggregation, which would reveal which coordinates each client moved;
* ``integer_field``: the compressor can also put an update on a grid every
  client shares (:class:`FieldCompressor`): integer codes below
  ``2**field_bits`` whose *sum* over clients decodes to the sum of their
  updates, so they can be summed in a secure aggregation's modular field
  (``field_bits + ceil(log2 n)`` bits a coordinate for ``n`` clients);
* ``stateful``: the kernel runs error feedback for it -- the client's
  residual (what compression left out) is added to its next update, and kept
  per client in the coordinator's client-local store, checkpointed;
* ``contractive``: ‖decode(encode(x))‖₂ ≤ ‖x‖₂ for every x, so a clip bound
  the client applied still holds for what it sends (client-side DP).
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

import attrs
import numpy as np

__all__ = ["CompressionTraits", "Compressor", "FieldCompressor", "compression_traits"]


@attrs.frozen
class CompressionTraits:
    """The declared properties of a compressor (the module docstring says what each means).

    The defaults are the safe reading of a compressor that declares
    nothing: biased, sparse, not field-capable, stateless, not contractive
    -- it composes only where nothing is assumed of it.
    """

    unbiased: bool = False
    sparse: bool = True
    integer_field: bool = False
    stateful: bool = False
    contractive: bool = False

    def __attrs_post_init__(self) -> None:
        for field in attrs.fields(type(self)):
            value = getattr(self, field.name)
            if not isinstance(value, bool):
                raise TypeError(f"CompressionTraits.{field.name} must be True or False, "
                                f"got {value!r} ({type(value).__name__})")


class Compressor(Protocol):
    """What a ``meshkit_compression`` factory builds (three methods and its traits)."""

    traits: CompressionTraits

    def encode(self, x: np.ndarray, *, seed: int) -> dict[str, np.ndarray]:
        """The fields that stand for ``x`` (1-d float32); ``seed`` drives any randomness
        (a function of the run seed, the round and the client)."""
        ...

    def decode(self, fields: Mapping[str, np.ndarray], size: int) -> np.ndarray:
        """The 1-d float32 vector of ``size`` elements ``fields`` stand for. The kernel has
        checked every field against :meth:`bounds` first; values (indices) are the
        decoder's to check, raising ``ValueError`` with what is wrong."""
        ...

    def bounds(self, size: int) -> dict[str, tuple[np.dtype, int]]:
        """Each field's dtype and most elements for a vector of ``size`` elements."""
        ...

    # Optional: ``decode_chunks(fields, size, step)`` yields ``(start, chunk)`` -- the
    # decoded vector's float32 coordinates ``start:start + len(chunk)``, in order, at most
    # ``step`` at a time, the same values :meth:`decode` gives -- so a linear fold adds a
    # contribution without a float copy of it (:class:`meshkit.compression.CompressedSum`).
    # Without it the coordinator decodes each key whole.


class FieldCompressor(Compressor, Protocol):
    """A compressor with the trait ``integer_field``: its grid is the round's, not its own.

    Under secure aggregation the coordinator must decode a *sum* of codes, so
    every client quantises onto one grid: ``[-clip_range, clip_range]``, the
    round's public ``[secure_aggregation] clip_range`` (nothing a client
    chose, so the grid reveals nothing of any update). The kernel checks the
    codes (integers, ``0 <= code < 2**field_bits``, one per coordinate)
    before they are masked.
    """

    #: Each code is below ``2**field_bits`` (1 to 32).
    field_bits: int

    def encode_field(self, x: np.ndarray, *, seed: int, clip_range: float) -> np.ndarray:
        """One integer code per coordinate of ``x`` (1-d float) on the shared grid;
        ``seed`` drives any randomness (stochastic rounding)."""
        ...

    def decode_field(self, total: np.ndarray, *, clip_range: float,
                     count: int) -> np.ndarray:
        """The float64 sum of ``count`` clients' updates whose codes sum to ``total``
        (exact integers, one per coordinate)."""
        ...


#: What a compressor that declares no ``traits`` is taken to be.
UNDECLARED = CompressionTraits()


def compression_traits(compressor: Any) -> CompressionTraits:
    """``compressor.traits`` when it declares them, else the safe reading (UNDECLARED)."""
    traits = compressor.traits if hasattr(compressor, "traits") else UNDECLARED
    if not isinstance(traits, CompressionTraits):
        raise TypeError(f"{type(compressor).__name__}.traits is {type(traits).__name__}, "
                        f"not a meshkit.compression.CompressionTraits")
    return traits
