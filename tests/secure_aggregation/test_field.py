"""How a masked vector travels: ``modulus_bits`` bits an element, packed, and back bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from meshkit.secure_aggregation import (field_width, from_wire, pack, packed_size, to_wire,
                                        unpack, vector_dtype)


@pytest.mark.parametrize("bits", [1, 4, 7, 8, 13, 15, 16, 24, 31, 33, 47, 63])
@pytest.mark.parametrize("size", [1, 3, 8, 9, 1000, (1 << 16) + 5])
def test_a_packed_vector_unpacks_to_itself_in_its_bytes(bits, size):
    rng = np.random.default_rng(bits * 7 + size)
    dtype = vector_dtype(bits)
    vector = (rng.integers(0, 1 << 62, size, dtype=np.uint64) & ((1 << bits) - 1)).astype(dtype)
    vector[0] = (1 << bits) - 1  # the top of the field survives
    packed = pack(vector, bits)
    assert packed.dtype == np.uint8 and packed.size == packed_size(size, bits) == \
        -(-size * bits // 8)
    back = unpack(packed, bits, size)
    assert back.dtype == dtype and back.tobytes() == vector.tobytes()


def test_the_layout_is_least_significant_bit_first_element_after_element():
    # 3 elements of 5 bits: 0b10101, 0b00011, 0b11111 -> bits 10101 11000 11111 (LSB first)
    packed = pack(np.array([0b10101, 0b00011, 0b11111], np.uint32), 5)
    bits = np.unpackbits(packed, bitorder="little")[:15]
    assert bits.tolist() == [1, 0, 1, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1]
    assert packed.size == 2 and int(packed[-1]) >> 7 == 0  # the spare bit is zero


@pytest.mark.parametrize("bad, words", [
    (lambda p: p[:-1], "pack into"),
    (lambda p: np.concatenate([p, np.zeros(1, np.uint8)]), "pack into"),
    (lambda p: p.astype(np.uint16), "pack into"),
    (lambda p: np.concatenate([p[:-1], p[-1:] | np.uint8(0x80)]), "spare bits"),
])
def test_a_packed_vector_of_the_wrong_size_or_with_spare_bits_set_is_refused(bad, words):
    packed = pack(np.arange(7, dtype=np.uint32), 15)  # 105 bits in 14 bytes: 7 spare
    with pytest.raises(ValueError, match=words):
        unpack(bad(packed), 15, 7)


def test_the_wire_form_is_packed_below_32_bits_and_the_array_itself_at_32_and_64():
    vector = np.arange(1000, dtype=np.uint32)
    narrow = to_wire(vector, 15)
    assert narrow["elements"] == 1000 and narrow["vector"].nbytes == 1875  # 15 bits each
    assert from_wire(narrow, 15).tobytes() == vector.tobytes()
    assert to_wire(vector, 32) == {"vector": vector}
    wide = np.arange(5, dtype=np.uint64)
    assert from_wire(to_wire(wide, 40), 40).tobytes() == wide.tobytes()
    with pytest.raises(ValueError, match="travels packed"):
        from_wire({"vector": vector}, 15)
    with pytest.raises(ValueError, match="travels as 1-d uint32"):
        from_wire(narrow, 32)


@pytest.mark.parametrize("bits, clients, width", [(8, 3, 10), (8, 100, 15), (8, 128, 15),
                                                  (8, 129, 16), (2, 1, 2), (4, 65536, 20)])
def test_the_field_holds_the_sum_of_the_clients_codes_exactly(bits, clients, width):
    assert field_width(bits, clients) == width
    assert clients * ((1 << bits) - 1) < 1 << width
