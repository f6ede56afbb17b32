"""``top-k``: each key's ``fraction`` largest-magnitude coordinates, with error feedback.

Sparsification as in Deep Gradient Compression (Lin et al., 2018) with the
error feedback of Stich, Cordonnier and Jaggi (*Sparsified SGD with
Memory*, 2018): the client compresses ``u = update + residual`` and keeps
``residual' = u - C(u)``, so nothing it ever computed is lost, only
delayed. The kernel runs the feedback (``stateful`` trait) and keeps each
client's residual in its client-local store. ``k = ceil(fraction * n)``
(at least 1).

What travels (:mod:`meshkit_compression.sparse` lays it out): by default
``k`` sorted uint32 indices and ``k`` float32 values, ``64 k / n`` bits per
coordinate. ``index = "gap8"`` sends the gaps between the indices as uint8
(fillers bridge a gap over 255), and ``value_bits = 8`` or ``4`` quantises
the values onto ``[-L, L]`` times one float32 scale a key -- so at ``gap8``
and 8 bits an entry costs 16 bits, and the same bytes keep 4× the
coordinates. Under error feedback the values round to the nearest code (the
residual takes the rounding error); without it they round at random, unbiased.

Without error feedback and with float32 values ``top-k`` is contractive
(‖topk(x)‖ ≤ ‖x‖), so a client's DP clip bound holds for what it sends; with
error feedback, or quantised values (a value may round up), it is not.
"""

from __future__ import annotations

import math
from typing import Iterator, Mapping

import numpy as np

from meshkit.compression import CompressionTraits
from meshkit_compression import sparse

__all__ = ["TopK"]


class TopK:
    """The ``k`` largest-magnitude coordinates of each key (ties: the lower index)."""

    def __init__(self, *, fraction: float = 0.01, error_feedback: bool = True,
                 value_bits: int = 32, index: str = "u32") -> None:
        if value_bits not in sparse.VALUE_BITS or isinstance(value_bits, bool):
            raise ValueError(f"value_bits must be 32, 8 or 4, got {value_bits!r}")
        if index not in sparse.INDEX:
            raise ValueError(f"index must be 'u32' or 'gap8', got {index!r}")
        self.fraction, self.error_feedback = float(fraction), bool(error_feedback)
        self.value_bits, self.index = int(value_bits), index
        self.traits = CompressionTraits(unbiased=False, sparse=True, integer_field=False,
                                        stateful=self.error_feedback,
                                        contractive=not self.error_feedback
                                        and self.value_bits == 32)

    def k(self, size: int) -> int:
        return max(1, min(size, math.ceil(self.fraction * size)))

    def bounds(self, size: int) -> dict[str, tuple[np.dtype, int]]:
        return sparse.bounds(self.index, self.value_bits, self.k(size), size)

    def encode(self, x: np.ndarray, *, seed: int) -> dict[str, np.ndarray]:
        k = self.k(x.size)
        # A stable sort on -|x| breaks ties by index: the same bits on every worker.
        position = np.sort(np.argsort(-np.abs(x), kind="stable")[:k]).astype(np.int64)
        return sparse.lay_out(position, x[position].astype(np.float32), index=self.index,
                              value_bits=self.value_bits, seed=seed,
                              stochastic=not self.error_feedback)

    def decode(self, fields: Mapping[str, np.ndarray], size: int) -> np.ndarray:
        position, value = self._checked(fields, size)
        out = np.zeros(size, np.float32)
        out[position] = value
        return out

    def decode_chunks(self, fields: Mapping[str, np.ndarray], size: int,
                      step: int) -> Iterator[tuple[int, np.ndarray]]:
        """:meth:`decode`'s vector ``step`` coordinates at a time: each range's zeros with
        its own positions' values scattered in (the positions are ascending)."""
        position, value = self._checked(fields, size)
        for start in range(0, size, step):
            stop = min(size, start + step)
            a, b = np.searchsorted(position, [start, stop])
            out = np.zeros(stop - start, np.float32)
            out[position[a:b] - start] = value[a:b]
            yield start, out

    def _checked(self, fields: Mapping[str, np.ndarray], size: int
                 ) -> tuple[np.ndarray, np.ndarray]:
        return sparse.entries(fields, index=self.index, value_bits=self.value_bits,
                              k=self.k(size), size=size)
