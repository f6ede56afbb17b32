"""Masks: a 256-bit seed expanded by ChaCha20 into a vector of integers mod ``2**modulus_bits``.

The hot path of a round: a client adds one mask per neighbour and its own
self-mask; the coordinator regenerates the self-masks of the survivors and
the pairwise masks of the dropped. A mask is the ChaCha20 keystream (RFC
8439 block function, via ``cryptography``/OpenSSL) under the full 32-byte
seed with an all-zero nonce and counter, read as little-endian words of the
vector's dtype (uint32 up to 32 bits, else uint64) and reduced mod
``2**modulus_bits`` by keeping the low bits: uniform, since each word is.
Every seed is used for one mask only (seeds are fresh per round and per
pair), so the fixed nonce is never reused under one key.

Modular arithmetic is numpy's wrapping unsigned arithmetic followed by a
mask of the low bits (no mask at 32 or 64 bits, where the dtype wraps
exactly at the modulus).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

__all__ = ["mask_vector", "add_mod", "sub_mod", "vector_dtype", "SEED_SIZE"]

#: Bytes of every seed (self-mask, pairwise): a full ChaCha20 key.
SEED_SIZE = 32
_NONCE = bytes(16)  # counter 0, nonce 0: each key masks one vector only


# Read-only zeros the keystream is "encrypted" from, a chunk at a time (the
# cipher's state carries on from chunk to chunk): reading them costs a fifth
# less than zeroing ``out`` first, and memory stays at one chunk.
_CHUNK = 1 << 22
_ZEROS = memoryview(bytes(_CHUNK))


def vector_dtype(modulus_bits: int) -> np.dtype:
    """The unsigned dtype a vector mod ``2**modulus_bits`` is held in: uint32 to 32 bits, else uint64."""
    if not 1 <= modulus_bits <= 64:
        raise ValueError(f"modulus_bits must be 1 to 64, got {modulus_bits}")
    return np.dtype(np.uint32 if modulus_bits <= 32 else np.uint64)


def _reduce(vector: np.ndarray, modulus_bits: int) -> np.ndarray:
    if modulus_bits not in (32, 64):
        np.bitwise_and(vector, vector.dtype.type((1 << modulus_bits) - 1), out=vector)
    return vector


def mask_vector(seed: bytes, length: int, modulus_bits: int,
                out: Optional[np.ndarray] = None) -> np.ndarray:
    """The mask of ``seed``: ``length`` integers mod ``2**modulus_bits`` from ChaCha20(seed).

    ``seed`` is exactly :data:`SEED_SIZE` bytes. ``out``, when given, is a
    C-contiguous array of ``length`` elements of :func:`vector_dtype` that
    receives the mask (no allocation); the mask is returned either way.
    """
    if not isinstance(seed, (bytes, bytearray)) or len(seed) != SEED_SIZE:
        raise ValueError(f"a mask seed is {SEED_SIZE} bytes")
    dtype = vector_dtype(modulus_bits)
    if out is None:
        out = np.empty(length, dtype=dtype)
    elif out.dtype != dtype or out.shape != (length,) or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous {dtype} array of {length} elements")
    raw = out.view(np.uint8).data
    encryptor = Cipher(algorithms.ChaCha20(bytes(seed), _NONCE), mode=None).encryptor()
    # Encrypting zeros leaves the keystream; OpenSSL writes it straight into ``out``.
    for start in range(0, len(raw), _CHUNK):
        piece = raw[start:start + _CHUNK]
        encryptor.update_into(_ZEROS[:len(piece)], piece)
    if dtype.byteorder == ">" or (dtype.byteorder == "=" and np.little_endian is False):
        out.byteswap(inplace=True)  # the keystream is read little-endian everywhere
    return _reduce(out, modulus_bits)


def add_mod(a: np.ndarray, b: np.ndarray, modulus_bits: int,
            out: Optional[np.ndarray] = None) -> np.ndarray:
    """``(a + b) mod 2**modulus_bits``, element-wise; ``out=a`` adds in place (a relay's fold)."""
    result = np.add(a, b, out=out, dtype=vector_dtype(modulus_bits), casting="unsafe")
    return _reduce(result, modulus_bits)


def sub_mod(a: np.ndarray, b: np.ndarray, modulus_bits: int,
            out: Optional[np.ndarray] = None) -> np.ndarray:
    """``(a - b) mod 2**modulus_bits``, element-wise; ``out=a`` subtracts in place."""
    result = np.subtract(a, b, out=out, dtype=vector_dtype(modulus_bits), casting="unsafe")
    return _reduce(result, modulus_bits)
