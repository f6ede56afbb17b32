"""meshkit._npz: the checkpoint's one-pass ``.npz`` writer, read back by numpy and zipfile.

Each case writes with :func:`write_npz` and reads with ``np.load`` (what
``--resume`` uses) and with ``zipfile`` (its CRC check and the entries'
sizes and offsets); the zip64 paths are taken by lowering the writer's
limits, which ``zipfile``'s reader does not share: it follows the markers
the writer puts in the records, so a wrong marker or a field out of order
fails to read.
"""

from __future__ import annotations

import io
import struct
import zipfile

import numpy as np
import pytest

from meshkit import _npz
from meshkit._npz import write_npz


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "__meta__": np.frombuffer(b'{"round": 3}', dtype=np.uint8),
        "state/w": rng.standard_normal((64, 32)).astype(np.float32),
        "state/b": rng.standard_normal(32),
        "state/n": np.arange(5, dtype=np.int64),
        "state/flag": np.array([True, False, True]),
        "state/scalar": np.array(2.5),
        "state/empty": np.zeros((0, 4), dtype=np.float32),
        "state/big-endian": np.arange(6, dtype=">i4").reshape(2, 3),  # numpy's own path
        "state/strided": np.arange(20.0).reshape(4, 5)[:, ::2],  # not contiguous: likewise
        "state/fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        "clients/7/μ": np.ones(3, dtype=np.float16),  # a non-ASCII name
    }


def _written(arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    write_npz(buf, arrays)
    return buf.getvalue()


def _check(raw: bytes, arrays: dict[str, np.ndarray]) -> None:
    with zipfile.ZipFile(io.BytesIO(raw)) as archive:
        assert archive.testzip() is None  # every entry's CRC-32 matches its bytes
        assert archive.namelist() == [name + ".npy" for name in arrays]
        for info in archive.infolist():
            assert info.compress_type == zipfile.ZIP_STORED
            # What the central directory says of the entry is what the entry is: its
            # sizes, and its local header where the offset points.
            assert info.file_size == info.compress_size == len(archive.read(info)), info
            assert raw[info.header_offset:info.header_offset + 4] == b"PK\x03\x04"
    locator = raw.rfind(b"PK\x06\x07")
    if locator >= 0:  # zip64: the locator points at the zip64 end record
        (end64,) = struct.unpack_from("<Q", raw, locator + 8)
        assert raw[end64:end64 + 4] == b"PK\x06\x06"
    with np.load(io.BytesIO(raw), allow_pickle=False) as data:
        assert data.files == list(arrays)
        for name, expected in arrays.items():
            got = data[name]
            assert got.dtype == expected.dtype and got.shape == expected.shape, name
            np.testing.assert_array_equal(got, expected)


def test_what_np_savez_writes_reads_back_the_same() -> None:
    arrays = _arrays()
    raw = _written(arrays)
    _check(raw, arrays)
    # The same entries and the same bytes in each as numpy's own savez.
    theirs = io.BytesIO()
    np.savez(theirs, **arrays)
    with zipfile.ZipFile(io.BytesIO(raw)) as mine, \
            zipfile.ZipFile(io.BytesIO(theirs.getvalue())) as savez:
        assert mine.namelist() == savez.namelist()
        for name in mine.namelist():
            assert mine.read(name) == savez.read(name), name


def test_a_second_write_with_cached_headers_is_byte_for_byte_the_first() -> None:
    arrays = _arrays()
    _npz._HEADERS.clear()
    first = _written(arrays)
    assert _npz._HEADERS  # the contiguous arrays' headers were kept
    assert _written(arrays) == first
    # A kept header never stands for another shape or dtype.
    changed = {**arrays, "state/w": np.zeros((32, 64), dtype=np.float64)}
    _check(_written(changed), changed)


def test_no_arrays_is_an_empty_archive() -> None:
    raw = _written({})
    with zipfile.ZipFile(io.BytesIO(raw)) as archive:
        assert archive.namelist() == []


@pytest.mark.parametrize("limits", [
    {"ZIP64_LIMIT": 100},          # sizes and offsets in the central directory's zip64 extra
    {"FILECOUNT_LIMIT": 3},        # the entry count in the zip64 end records
    {"ZIP64_LIMIT": 100, "FILECOUNT_LIMIT": 3},
])
def test_zip64_records_where_a_size_an_offset_or_the_count_needs_them(
        monkeypatch: pytest.MonkeyPatch, limits: dict[str, int]) -> None:
    for name, value in limits.items():
        monkeypatch.setattr(_npz, name, value)
    arrays = _arrays()
    raw = _written(arrays)
    assert (b"PK\x06\x06" in raw) == (limits.get("FILECOUNT_LIMIT") == 3
                                       or "ZIP64_LIMIT" in limits)
    _check(raw, arrays)


def test_a_corrupted_byte_is_caught_by_the_crc() -> None:
    arrays = {"state/w": np.arange(1000, dtype=np.float32)}
    raw = bytearray(_written(arrays))
    raw[raw.index(np.arange(1000, dtype=np.float32).tobytes()[40:48]) + 1] ^= 0xFF
    with zipfile.ZipFile(io.BytesIO(bytes(raw))) as archive:
        assert archive.testzip() == "state/w.npy"
