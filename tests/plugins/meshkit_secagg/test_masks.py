"""Masks: ChaCha20 under the full seed, reduced mod 2**bits; modular add and subtract."""

from __future__ import annotations

import numpy as np
import pytest

from meshkit_secagg import add_mod, mask_vector, sub_mod, vector_dtype


@pytest.mark.parametrize("bits", [1, 7, 20, 32, 33, 63, 64])
def test_a_mask_is_below_the_modulus_and_a_function_of_its_seed(bits: int) -> None:
    seed = bytes(range(32))
    mask = mask_vector(seed, 4096, bits)
    assert mask.dtype == vector_dtype(bits)
    assert int(mask.max()) < 2 ** bits
    assert np.array_equal(mask, mask_vector(seed, 4096, bits))
    assert not np.array_equal(mask, mask_vector(bytes(31) + b"\x01", 4096, bits))


def test_a_mask_is_the_chacha20_keystream_read_little_endian() -> None:
    # RFC 8439 §2.4.2's block function, key 00..1f, nonce 0, counter 0: its first
    # keystream bytes under an all-zero nonce (computed independently here).
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
    seed = bytes(range(32))
    stream = Cipher(algorithms.ChaCha20(seed, bytes(16)), mode=None).encryptor().update(bytes(64))
    assert mask_vector(seed, 16, 32).tolist() == list(np.frombuffer(stream, "<u4"))
    assert mask_vector(seed, 16, 12).tolist() == [w & 0xFFF for w in np.frombuffer(stream, "<u4")]


def test_every_bit_of_the_seed_matters() -> None:
    # The seed is never folded (Flower's masks: a seed folded to 32 bits into MT19937).
    seed = bytearray(32)
    base = mask_vector(bytes(seed), 64, 32)
    for byte in (0, 4, 8, 31):
        flipped = bytearray(seed)
        flipped[byte] ^= 0x80
        assert not np.array_equal(base, mask_vector(bytes(flipped), 64, 32))


def test_a_mask_can_be_written_into_a_given_buffer() -> None:
    out = np.full(100, 7, dtype=np.uint32)
    returned = mask_vector(bytes(32), 100, 32, out=out)
    assert returned is out
    assert np.array_equal(out, mask_vector(bytes(32), 100, 32))
    with pytest.raises(ValueError, match="C-contiguous uint32"):
        mask_vector(bytes(32), 100, 32, out=np.zeros(100, np.uint64))
    with pytest.raises(ValueError, match="32 bytes"):
        mask_vector(bytes(16), 100, 32)


@pytest.mark.parametrize("bits", [5, 32, 40, 64])
def test_adding_and_subtracting_a_mask_gives_the_input_back(bits: int) -> None:
    x = mask_vector(bytes([3]) * 32, 1000, bits)  # any vector below the modulus
    mask = mask_vector(bytes([9]) * 32, 1000, bits)
    masked = add_mod(x, mask, bits)
    assert int(masked.max()) < 2 ** bits
    assert np.array_equal(sub_mod(masked, mask, bits), x)
    expected = [(int(a) + int(b)) % 2 ** bits for a, b in zip(x, mask)]
    assert masked.tolist() == expected


def test_a_mask_longer_than_one_chunk_is_one_keystream() -> None:
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
    seed = bytes([5]) * 32
    length = (1 << 20) + 3  # 4 MiB + 12 bytes of uint32: past the first chunk
    stream = Cipher(algorithms.ChaCha20(seed, bytes(16)), mode=None).encryptor().update(
        bytes(4 * length))
    assert np.array_equal(mask_vector(seed, length, 32), np.frombuffer(stream, "<u4"))
