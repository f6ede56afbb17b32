"""The field a secure round sums in: the integers mod ``2**modulus_bits``, 1 <= bits <= 64.

Rule: every modular addition the kernel makes (a worker folding its clients'
masked inputs, a host relay folding its ranks') is :func:`add_mod`, so what
a scheme promises -- the masks cancel in the sum mod ``2**modulus_bits`` --
holds whatever path the vectors took. A vector mod ``2**b`` is held as uint32
up to 32 bits, else uint64; numpy's unsigned arithmetic wraps at the dtype's
width and the low ``b`` bits are kept (no mask at 32 or 64 bits).

On the wire a masked vector costs ``modulus_bits`` bits an element, not its
dtype's width (:func:`to_wire`, :func:`from_wire`): at 32 or 64 bits it
travels as the uint32 or uint64 array itself; at any other width it is
*packed*, element after element, each its low ``modulus_bits`` bits,
least significant bit first, into ``ceil(n * modulus_bits / 8)`` bytes
(the last byte's spare high bits zero), and the message names ``n``
(``elements``). A 15-bit field (int8 codes summed over up to 128 clients)
sends 15 bits a coordinate where the uint32 array would send 32.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np

__all__ = ["vector_dtype", "add_mod", "pack", "unpack", "to_wire", "from_wire",
           "packed_size", "field_width"]

#: Elements packed or unpacked at once (a multiple of 8, so every slice starts on a
#: byte): bounds the scratch memory at 64 bytes an element of one slice.
_SLICE = 1 << 16


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


def field_width(input_bits: int, clients: int) -> int:
    """The narrowest field in which ``clients`` integers below ``2**input_bits`` sum exactly:
    ``input_bits + ceil(log2 clients)`` bits (their sum is at most
    ``clients * (2**input_bits - 1) < 2**(input_bits + ceil(log2 clients))``)."""
    if input_bits < 1 or clients < 1:
        raise ValueError(f"input_bits and clients must be >= 1, got {input_bits}, {clients}")
    return input_bits + (clients - 1).bit_length()


def packed_size(elements: int, modulus_bits: int) -> int:
    """Bytes of ``elements`` packed at ``modulus_bits`` bits each."""
    return -(-elements * modulus_bits // 8)


def pack(vector: np.ndarray, modulus_bits: int) -> np.ndarray:
    """``vector`` (of :func:`vector_dtype`, values below ``2**modulus_bits``) as packed bytes.

    Element ``i``'s bit ``j`` is bit ``i * modulus_bits + j`` of the result,
    counting from the least significant bit of byte 0 (module docstring).
    """
    dtype = vector_dtype(modulus_bits)
    if vector.dtype != dtype or vector.ndim != 1:
        raise ValueError(f"a vector mod 2^{modulus_bits} is 1-d {dtype}, got "
                         f"{vector.dtype}{list(vector.shape)}")
    width = dtype.itemsize
    words = vector.astype(dtype.newbyteorder("<"), copy=False)
    out = np.empty(packed_size(vector.size, modulus_bits), np.uint8)
    for start in range(0, vector.size, _SLICE):
        part = words[start:start + _SLICE]
        bits = np.unpackbits(part.view(np.uint8).reshape(part.size, width), axis=1,
                             bitorder="little")[:, :modulus_bits]
        first = start * modulus_bits // 8  # _SLICE is a multiple of 8: a whole byte
        chunk = np.packbits(bits.ravel(), bitorder="little")
        out[first:first + chunk.size] = chunk
    return out


def unpack(packed: np.ndarray, modulus_bits: int, elements: int) -> np.ndarray:
    """The ``elements`` integers mod ``2**modulus_bits`` :func:`pack` made ``packed`` from.

    Raises ``ValueError`` for a byte count that is not
    ``ceil(elements * modulus_bits / 8)`` or spare bits that are not zero
    (one vector has one packing).
    """
    dtype = vector_dtype(modulus_bits)
    if not isinstance(packed, np.ndarray) or packed.dtype != np.uint8 or packed.ndim != 1 \
            or packed.size != packed_size(elements, modulus_bits):
        shown = (f"{packed.dtype}{list(packed.shape)}" if isinstance(packed, np.ndarray)
                 else type(packed).__name__)
        raise ValueError(f"{elements} elements of {modulus_bits} bits pack into "
                         f"{packed_size(elements, modulus_bits)} bytes (1-d uint8), got "
                         f"{shown}")
    spare = packed.size * 8 - elements * modulus_bits
    if spare and int(packed[-1]) >> (8 - spare):
        raise ValueError(f"the packed vector's last {spare} spare bits are not zero")
    width = dtype.itemsize
    out = np.empty(elements, dtype.newbyteorder("<"))
    for start in range(0, elements, _SLICE):
        count = min(_SLICE, elements - start)
        first = start * modulus_bits // 8
        bits = np.unpackbits(packed[first:first + packed_size(count, modulus_bits)],
                             count=count * modulus_bits, bitorder="little")
        wide = np.zeros((count, 8 * width), np.uint8)
        wide[:, :modulus_bits] = bits.reshape(count, modulus_bits)
        out[start:start + count] = np.packbits(wide, axis=1, bitorder="little").view(
            out.dtype).ravel()
    return out.astype(dtype, copy=False)


def to_wire(vector: np.ndarray, modulus_bits: int) -> dict[str, Any]:
    """A masked vector's message fields: ``{"vector": ...}``, packed with ``elements`` below
    32 bits or between 32 and 64 (module docstring)."""
    if modulus_bits in (32, 64):
        return {"vector": vector}
    return {"vector": pack(vector, modulus_bits), "elements": int(vector.size)}


def from_wire(message: Mapping[str, Any], modulus_bits: int) -> np.ndarray:
    """The masked vector of a message :func:`to_wire` made; ``ValueError`` when it does not fit
    the field (a packed vector at 32 or 64 bits, a whole one at another width, a bad packing)."""
    vector, elements = message.get("vector"), message.get("elements")
    if not isinstance(vector, np.ndarray):
        raise ValueError(f"no masked vector (got {type(vector).__name__})")
    if modulus_bits in (32, 64):
        if elements is not None or vector.dtype != vector_dtype(modulus_bits):
            raise ValueError(f"a vector mod 2^{modulus_bits} travels as 1-d "
                             f"{vector_dtype(modulus_bits)}, got {vector.dtype} "
                             f"{'packed' if elements is not None else ''}".rstrip())
        return vector
    if type(elements) is not int or elements < 1:
        raise ValueError(f"a vector mod 2^{modulus_bits} travels packed, with its element "
                         f"count; got {vector.dtype}{list(vector.shape)} and elements = "
                         f"{elements!r}")
    return unpack(vector, modulus_bits, elements)
