"""The field a secure round sums in: the integers mod ``2**modulus_bits``, 1 <= bits <= 64.

Rule: every modular addition the kernel makes (a worker folding its clients'
masked inputs, a host relay folding its ranks') is :func:`add_mod`, so what
a scheme promises -- the masks cancel in the sum mod ``2**modulus_bits`` --
holds whatever path the vectors took. A vector mod ``2**b`` is held as uint32
up to 32 bits, else uint64; numpy's unsigned arithmetic wraps at the dtype's
width and the low ``b`` bits are kept (no mask at 32 or 64 bits).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

__all__ = ["vector_dtype", "add_mod"]


def vector_dtype(modulus_bits: int) -> np.dtype:
    """The unsigned dtype of a vector mod ``2**modulus_bits``: uint32 to 32 bits, else uint64."""
    if not 1 <= modulus_bits <= 64:
        raise ValueError(f"modulus_bits must be 1 to 64, got {modulus_bits}")
    return np.dtype(np.uint32 if modulus_bits <= 32 else np.uint64)


def add_mod(a: np.ndarray, b: np.ndarray, modulus_bits: int,
            out: Optional[np.ndarray] = None) -> np.ndarray:
    """``(a + b) mod 2**modulus_bits``, element-wise; ``out=a`` adds in place (a fold)."""
    result = np.add(a, b, out=out, dtype=vector_dtype(modulus_bits), casting="unsafe")
    if modulus_bits not in (32, 64):
        np.bitwise_and(result, result.dtype.type((1 << modulus_bits) - 1), out=result)
    return result
