"""meshkit_observers.event_file: TFRecord framing and the Event protobuf, read by TensorBoard."""

from __future__ import annotations

import struct

import pytest

from meshkit_observers.event_file import EventFile, crc32c, masked_crc32c


def test_crc32c_is_castagnolis():
    # The standard check value of CRC-32C (RFC 3720, iSCSI).
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0


def test_every_record_is_framed_with_masked_crcs(tmp_path):
    events = EventFile(tmp_path)
    events.scalars(1, {"loss": 0.5})
    events.close()
    raw = events.path.read_bytes()
    records = 0
    offset = 0
    while offset < len(raw):
        header = raw[offset:offset + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", raw[offset + 8:offset + 12])[0] == masked_crc32c(header)
        data = raw[offset + 12:offset + 12 + length]
        assert struct.unpack("<I", raw[offset + 12 + length:offset + 16 + length])[0] == \
            masked_crc32c(data)
        offset += 16 + length
        records += 1
    assert records == 2  # the file_version event, then the scalars


def test_tensorboards_reader_reads_scalars_and_text(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventFile(tmp_path)
    events.text(0, "config", "[run]\nseed = 7\n")
    for step, loss in enumerate([0.9, 0.5, 0.25]):
        events.scalars(step + 1, {"loss": loss, "accuracy": 1 - loss})
    events.close()

    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3]
    assert [e.value for e in acc.Scalars("loss")] == pytest.approx([0.9, 0.5, 0.25], rel=1e-6)
    assert [e.step for e in acc.Scalars("accuracy")] == [1, 2, 3]
    (text,) = acc.Tensors("config")
    assert text.tensor_proto.string_val[0].decode() == "[run]\nseed = 7\n"
    assert acc.summary_metadata["config"].plugin_data.plugin_name == "text"
