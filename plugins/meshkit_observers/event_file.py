"""TensorBoard event files, written without TensorFlow, TensorBoard or protobuf.

An event file (``events.out.tfevents.<seconds>.<host>``) is a TFRecord
stream of serialized ``tensorflow.Event`` protocol buffers. Each record is::

    uint64 length (little-endian)
    uint32 masked CRC-32C of the 8 length bytes
    length bytes of data (one Event)
    uint32 masked CRC-32C of the data

where ``masked(crc) = ((crc >> 15 | crc << 17) + 0xA282EAD8) mod 2**32``. The
first record is an Event with ``file_version = "brain.Event:2"``. The few
protobuf fields written here, with their field numbers, are::

    Event         wall_time 1 (double), step 2 (int64), file_version 3 (string),
                  summary 5 (Summary)
    Summary       value 1 (repeated Value)
    Value         tag 1 (string), simple_value 2 (float), tensor 8 (TensorProto),
                  metadata 9 (SummaryMetadata)
    SummaryMetadata  plugin_data 1 (PluginData: plugin_name 1, content 2)
    TensorProto   dtype 1 (DT_STRING = 7), tensor_shape 2 (scalar: empty),
                  string_val 8 (repeated bytes)

A scalar is a ``simple_value`` (TensorBoard's scalar dashboard); a text is a
string tensor whose metadata names the ``text`` plugin (its text dashboard).
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path
from typing import BinaryIO

__all__ = ["EventFile", "crc32c", "masked_crc32c"]


def _crc_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # Castagnoli, reflected
        table.append(crc)
    return table


_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``: what TFRecord checksums use."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


# -- protobuf, the few wire types used ------------------------------------------


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # int64 two's complement, as protobuf encodes negatives
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _bytes_field(field: int, data: bytes) -> bytes:
    return _key(field, 2) + _varint(len(data)) + data


def _event(step: int, *, summary: bytes | None = None, file_version: str | None = None,
           wall_time: float | None = None) -> bytes:
    out = _key(1, 1) + struct.pack("<d", time.time() if wall_time is None else wall_time)
    out += _key(2, 0) + _varint(step)
    if file_version is not None:
        out += _bytes_field(3, file_version.encode("utf-8"))
    if summary is not None:
        out += _bytes_field(5, summary)
    return out


def _scalar_value(tag: str, value: float) -> bytes:
    return _bytes_field(1, tag.encode("utf-8")) + _key(2, 5) + struct.pack("<f", value)


def _text_value(tag: str, text: str) -> bytes:
    plugin_data = _bytes_field(1, b"text")
    metadata = _bytes_field(1, plugin_data)
    tensor = _key(1, 0) + _varint(7) + _bytes_field(2, b"") + _bytes_field(8, text.encode("utf-8"))
    return _bytes_field(1, tag.encode("utf-8")) + _bytes_field(8, tensor) + \
        _bytes_field(9, metadata)


class EventFile:
    """One event file in ``directory``, opened for appending records; flushed after each."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        # TensorBoard reads every events.out.tfevents.* file of a directory in
        # name order; the pid keeps two runs started in the same second apart.
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self.path = self.directory / name
        self._fh: BinaryIO | None = open(self.path, "ab")
        self._record(_event(0, file_version="brain.Event:2"))

    def _record(self, data: bytes) -> None:
        if self._fh is None:
            raise ValueError(f"{self.path}: the event file is closed")
        length = struct.pack("<Q", len(data))
        self._fh.write(length + struct.pack("<I", masked_crc32c(length)) + data +
                       struct.pack("<I", masked_crc32c(data)))
        self._fh.flush()

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """One event holding every ``tag -> value`` at ``step``."""
        summary = b"".join(_bytes_field(1, _scalar_value(tag, value))
                           for tag, value in values.items())
        self._record(_event(step, summary=summary))

    def text(self, step: int, tag: str, text: str) -> None:
        """A text summary (TensorBoard's Text dashboard) at ``step``."""
        self._record(_event(step, summary=_bytes_field(1, _text_value(tag, text))))

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
