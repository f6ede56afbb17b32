"""``top-k``: each key's ``fraction`` largest-magnitude coordinates, with error feedback.

Sparsification as in Deep Gradient Compression (Lin et al., 2018) with the
error feedback of Stich, Cordonnier and Jaggi (*Sparsified SGD with
Memory*, 2018): the client compresses ``u = update + residual`` and keeps
``residual' = u - topk(u)``, so nothing it ever computed is lost, only
delayed. The kernel runs the feedback (``stateful`` trait) and keeps each
client's residual in its client-local store. ``k = ceil(fraction * n)``
(at least 1); what travels is ``k`` sorted uint32 indices and ``k`` float32
values: ``64 k / n`` bits per coordinate.

Without error feedback ``top-k`` is contractive (‖topk(x)‖ ≤ ‖x‖), so a
client's DP clip bound holds for what it sends; with it, it is not.
"""

from __future__ import annotations

import math
from typing import Iterator, Mapping

import numpy as np

from meshkit.compression import CompressionTraits

__all__ = ["TopK"]


class TopK:
    """The ``k`` largest-magnitude coordinates of each key (ties: the lower index)."""

    def __init__(self, *, fraction: float = 0.01, error_feedback: bool = True) -> None:
        self.fraction, self.error_feedback = float(fraction), bool(error_feedback)
        self.traits = CompressionTraits(unbiased=False, sparse=True, integer_field=False,
                                        stateful=self.error_feedback,
                                        contractive=not self.error_feedback)

    def k(self, size: int) -> int:
        return max(1, min(size, math.ceil(self.fraction * size)))

    def bounds(self, size: int) -> dict[str, tuple[np.dtype, int]]:
        k = self.k(size)
        return {"index": (np.dtype(np.uint32), k), "value": (np.dtype(np.float32), k)}

    def encode(self, x: np.ndarray, *, seed: int) -> dict[str, np.ndarray]:
        k = self.k(x.size)
        # A stable sort on -|x| breaks ties by index: the same bits on every worker.
        index = np.sort(np.argsort(-np.abs(x), kind="stable")[:k]).astype(np.uint32)
        return {"index": index, "value": x[index].astype(np.float32)}

    def decode(self, fields: Mapping[str, np.ndarray], size: int) -> np.ndarray:
        index, value = self._checked(fields, size)
        out = np.zeros(size, np.float32)
        out[index] = value
        return out

    def decode_chunks(self, fields: Mapping[str, np.ndarray], size: int,
                      step: int) -> Iterator[tuple[int, np.ndarray]]:
        """:meth:`decode`'s vector ``step`` coordinates at a time: each range's zeros with
        its own indices' values scattered in (the indices are sorted)."""
        index, value = self._checked(fields, size)
        for start in range(0, size, step):
            stop = min(size, start + step)
            a, b = np.searchsorted(index, [start, stop])
            out = np.zeros(stop - start, np.float32)
            out[index[a:b].astype(np.int64) - start] = value[a:b]
            yield start, out

    def _checked(self, fields: Mapping[str, np.ndarray], size: int
                 ) -> tuple[np.ndarray, np.ndarray]:
        index, value = fields["index"], fields["value"]
        k = self.k(size)
        if index.size != k or value.size != k:
            raise ValueError(f"{index.size} indices and {value.size} values; top-k of "
                             f"{size} coordinates sends {k} of each")
        if k and (int(index[-1]) >= size or (np.diff(index.astype(np.int64)) <= 0).any()):
            raise ValueError(f"the indices must be ascending, distinct and below {size}")
        if not np.isfinite(value).all():
            raise ValueError("a value is not finite")
        return index, value
