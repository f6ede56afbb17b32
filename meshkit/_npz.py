"""A stored ``.npz`` written straight from the arrays' memory, in one pass.

What ``np.savez(fh, **arrays)`` writes -- a zip of ``NAME.npy`` entries, stored
(not compressed), with zip64 sizes -- for a file the checkpoint rewrites
every round (issue 36). ``zipfile`` writes an entry's local header, its data,
then seeks back to fill in the CRC and the sizes it did not know; that is
~1,000 lines of Python a checkpoint of a few arrays, about a sixth of a
small model's round on the coordinator. Here every entry's CRC and size are
known before its header is written: the ``.npy`` header is a few bytes and
the array's CRC-32 one ``zlib.crc32`` over its memory. So each entry is its
header and its data, written once, and the central directory follows.

Every local header carries the zip64 sizes (as ``force_zip64`` does), so the
same layout holds at any size; the central directory and the end records
use zip64 where a size, an offset or the entry count needs it, as
``zipfile`` does. Readers: ``np.load`` and ``zipfile`` (tests/kernel/test_npz.py).
"""

from __future__ import annotations

import io
import struct
import zlib
from typing import Any, BinaryIO, Mapping

import numpy as np

__all__ = ["write_npz"]

#: Above this a size or an offset needs zip64 (zipfile.ZIP64_LIMIT).
ZIP64_LIMIT = (1 << 31) - 1
#: Above this an entry count needs zip64 (zipfile.ZIP_FILECOUNT_LIMIT).
FILECOUNT_LIMIT = (1 << 16) - 1

_LOCAL = struct.Struct("<4s2B4HL2L2H")
_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")
_END = struct.Struct("<4s4H2LH")
_END64 = struct.Struct("<4sQ2H2L4Q")
_LOCATOR64 = struct.Struct("<4sLQL")
_ZIP64_SIZES = struct.Struct("<HHQQ")

#: Version 4.5 (zip64), made on Unix (3), as zipfile writes for a forced-zip64 entry.
_VERSION = 45
_UNIX = 3
#: ZipInfo's default time stamp, 1980-01-01 00:00:00, in DOS form.
_DOS_DATE = (1 << 5) | 1
_DOS_TIME = 0
#: ``-rw-------`` in the high half, as ``ZipFile.open(name, "w")`` sets.
_EXTERNAL = 0o600 << 16
#: General purpose flag bit 11: the name is UTF-8.
_UTF8 = 0x800


#: ``.npy`` headers by (dtype, shape): a checkpoint's arrays keep theirs from round to
#: round, and numpy's header writer is ~45 lines of Python an array.
_HEADERS: dict[tuple[np.dtype, tuple[int, ...]], bytes] = {}
_HEADERS_KEPT = 1024


def _npy(value: Any) -> tuple[bytes, Any]:
    """An entry's ``.npy`` header and its data (a flat uint8 view when it can be one)."""
    array = np.asanyarray(value)
    fmt = np.lib.format
    if not (array.dtype.kind in "biuf" and array.dtype.isnative
            and array.flags.c_contiguous and type(array) is np.ndarray):
        whole = io.BytesIO()
        fmt.write_array(whole, array, allow_pickle=False)  # numpy's own bytes, as savez
        return whole.getvalue(), b""
    key = (array.dtype, array.shape)
    head = _HEADERS.get(key)
    if head is None:
        out = io.BytesIO()
        header = fmt.header_data_from_array_1_0(array)
        try:
            fmt.write_array_header_1_0(out, header)
        except ValueError:  # a header too long for format 1.0
            fmt.write_array_header_2_0(out, header)
        head = out.getvalue()
        if len(_HEADERS) >= _HEADERS_KEPT:
            _HEADERS.clear()
        _HEADERS[key] = head
    return head, array.reshape(-1).view(np.uint8).data


def write_npz(fh: BinaryIO, arrays: Mapping[str, Any]) -> None:
    """Write ``arrays`` to ``fh`` as ``np.savez`` would (stored ``NAME.npy`` entries)."""
    central = []
    offset = 0
    for name, value in arrays.items():
        head, data = _npy(value)
        size = len(head) + len(data)  # data: bytes, or a flat uint8 view (len is its bytes)
        crc = zlib.crc32(data, zlib.crc32(head))
        raw = (name + ".npy").encode("utf-8")
        flags = 0 if raw.isascii() else _UTF8
        extra = _ZIP64_SIZES.pack(1, 16, size, size)
        fh.write(_LOCAL.pack(b"PK\003\004", _VERSION, 0, flags, 0, _DOS_TIME, _DOS_DATE, crc,
                             0xFFFFFFFF, 0xFFFFFFFF, len(raw), len(extra)) + raw + extra + head)
        fh.write(data)
        central.append((raw, flags, crc, size, offset))
        offset += _LOCAL.size + len(raw) + len(extra) + size
    start = offset
    for raw, flags, crc, size, at in central:
        fields = []
        if size > ZIP64_LIMIT:
            fields += [size, size]
        if at > ZIP64_LIMIT:
            fields.append(at)
        extra = struct.pack(f"<HH{len(fields)}Q", 1, 8 * len(fields), *fields) if fields else b""
        record = _CENTRAL.pack(
            b"PK\001\002", _VERSION, _UNIX, _VERSION, 0, flags, 0, _DOS_TIME, _DOS_DATE, crc,
            0xFFFFFFFF if size > ZIP64_LIMIT else size,
            0xFFFFFFFF if size > ZIP64_LIMIT else size,
            len(raw), len(extra), 0, 0, 0, _EXTERNAL,
            0xFFFFFFFF if at > ZIP64_LIMIT else at) + raw + extra
        fh.write(record)
        offset += len(record)
    count, length = len(central), offset - start
    if count > FILECOUNT_LIMIT or start > ZIP64_LIMIT or length > ZIP64_LIMIT:
        fh.write(_END64.pack(b"PK\006\006", _END64.size - 12, _VERSION, _VERSION, 0, 0,
                             count, count, length, start))
        fh.write(_LOCATOR64.pack(b"PK\006\007", 0, offset, 1))
        count, length, start = (min(count, 0xFFFF), min(length, 0xFFFFFFFF),
                                min(start, 0xFFFFFFFF))
    fh.write(_END.pack(b"PK\005\006", 0, 0, count, count, length, start, 0))
