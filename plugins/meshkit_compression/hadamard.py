"""``rotate = true``: a randomised Hadamard rotation before compressing, undone after.

``y = H D x / sqrt(B)`` per block of ``B`` coordinates (``B`` the next power
of two of the key's size, at most :data:`BLOCK`), ``D`` a diagonal of random
signs drawn from a seed that travels with the payload (field ``rotation``,
8 bytes). The rotation is orthogonal, so it keeps a vector's norm (a
contractive compressor stays contractive) and, being linear, an unbiased
one stays unbiased; it spreads a few large coordinates over the whole
block, which shrinks a chunk's range (Suresh et al., *Distributed Mean
Estimation with Limited Communication*, 2017).
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import numpy as np

from meshkit.compression import CompressionTraits

__all__ = ["Rotated", "BLOCK", "fwht"]

#: The largest block rotated at once (the transform costs log2(BLOCK) passes).
BLOCK = 4096


def _block(size: int) -> int:
    return min(BLOCK, 1 << max(0, (size - 1).bit_length()))


def fwht(x: np.ndarray) -> np.ndarray:
    """The orthonormal Walsh-Hadamard transform of each row of ``x`` (rows a power of two)."""
    rows, width = x.shape
    y = x.astype(np.float64, copy=True)
    h = 1
    while h < width:
        view = y.reshape(rows, width // (2 * h), 2, h)
        a, b = view[:, :, 0, :].copy(), view[:, :, 1, :]
        view[:, :, 0, :] += b
        view[:, :, 1, :] = a - b
        h *= 2
    return y / np.sqrt(width)


def _signs(seed: np.ndarray, count: int) -> np.ndarray:
    return _drawn(_sign_stream(seed), count)


def _sign_stream(seed: np.ndarray) -> np.random.Generator:
    return np.random.default_rng(int(seed.view(np.uint64)[0]))


def _drawn(stream: np.random.Generator, count: int) -> np.ndarray:
    """The next ``count`` signs of ``stream``: drawn a part at a time, the same signs as at
    once (each float64 draw takes one 64-bit word of the generator)."""
    return np.where(stream.random(count) < 0.5, -1.0, 1.0)


class Rotated:
    """``inner`` applied to the rotated vector (module docstring)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        t = inner.traits
        # Not integer_field: the signs D are drawn per client (from its fit's seed), so two
        # clients' codes are on different grids and their sum means nothing.
        self.traits = CompressionTraits(unbiased=t.unbiased, sparse=t.sparse,
                                        integer_field=False, stateful=t.stateful,
                                        contractive=t.contractive)

    def _padded(self, size: int) -> int:
        block = _block(size)
        return -(-size // block) * block

    def bounds(self, size: int) -> dict[str, tuple[np.dtype, int]]:
        return {**self.inner.bounds(self._padded(size)), "rotation": (np.dtype(np.uint32), 2)}

    def encode(self, x: np.ndarray, *, seed: int) -> dict[str, np.ndarray]:
        size, padded, block = x.size, self._padded(x.size), _block(x.size)
        rotation = np.array([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF], np.uint32)
        y = np.zeros(padded, np.float64)
        y[:size] = x
        y *= _signs(rotation, padded)
        rotated = fwht(y.reshape(-1, block)).ravel().astype(np.float32)
        inner_seed = int(np.random.SeedSequence([int(seed), 1]).generate_state(1, np.uint64)[0])
        return {**self.inner.encode(rotated, seed=inner_seed), "rotation": rotation}

    def decode(self, fields: Mapping[str, np.ndarray], size: int) -> np.ndarray:
        rotation = _rotation(fields)
        padded, block = self._padded(size), _block(size)
        inner = {k: v for k, v in fields.items() if k != "rotation"}
        y = self.inner.decode(inner, padded).astype(np.float64)
        x = fwht(y.reshape(-1, block)).ravel() * _signs(rotation, padded)
        return x[:size].astype(np.float32)

    def decode_chunks(self, fields: Mapping[str, np.ndarray], size: int,
                      step: int) -> Iterator[tuple[int, np.ndarray]]:
        """:meth:`decode`'s vector ``step`` coordinates at a time, the same bits: the rotation
        works per block, so the inner vector is gathered a whole number of blocks at a time
        (the inner decoder's ``decode_chunks`` when it has one), each rotated back on its
        own with the next signs of the same stream. Scratch: about ``max(step, block)``
        coordinates, never the whole vector (unless the inner decoder decodes whole)."""
        signs = _sign_stream(_rotation(fields))
        padded, block = self._padded(size), _block(size)
        inner = {k: v for k, v in fields.items() if k != "rotation"}
        span = max(1, step // block) * block
        buf, filled, at = np.empty(span, np.float64), 0, 0
        for part in _inner_parts(self.inner, inner, padded, span):
            i = 0
            while i < part.size:
                take = min(span - filled, part.size - i)
                buf[filled:filled + take] = part[i:i + take]
                filled, i = filled + take, i + take
                if filled == span:
                    yield from _rotated_back(buf, span, block, signs, at, size, step)
                    filled, at = 0, at + span
        if filled:  # the padded vector is whole blocks: so is what is left
            yield from _rotated_back(buf, filled, block, signs, at, size, step)


def _rotation(fields: Mapping[str, np.ndarray]) -> np.ndarray:
    rotation = fields["rotation"]
    if rotation.size != 2:
        raise ValueError(f"the rotation's seed is 2 uint32, got {rotation.size}")
    return rotation


def _inner_parts(inner: Any, fields: Mapping[str, np.ndarray], padded: int,
                 span: int) -> Iterator[np.ndarray]:
    """The inner decoder's vector in order, ``span`` coordinates at a time when it decodes
    in chunks, else whole."""
    chunks = getattr(inner, "decode_chunks", None)
    if chunks is None:
        yield inner.decode(fields, padded)
        return
    for _, part in chunks(fields, padded, span):
        yield part


def _rotated_back(buf: np.ndarray, n: int, block: int, signs: np.random.Generator, at: int,
                  size: int, step: int) -> Iterator[tuple[int, np.ndarray]]:
    """The ``n`` coordinates in ``buf`` (whole blocks, starting at ``at``) rotated back, cut
    to the vector's ``size`` and yielded ``step`` at a time as float32."""
    x = fwht(buf[:n].reshape(-1, block)).ravel() * _drawn(signs, n)
    stop = min(n, size - at)
    for lo in range(0, max(0, stop), step):
        yield at + lo, x[lo:min(stop, lo + step)].astype(np.float32)
