"""A message bigger than one segment: how it is cut on the way out and put back on the way in.

A body larger than the link's segment size (``Channel.segment_bytes``: the
smaller of the two ends' ``[mesh] segment_bytes``, announced in the hellos,
and of their ``max_frame``) is sent as a *lead* frame (``FLAG_SEGMENTED``,
its body the message's size and how it is cut, :data:`SEGMENT_LEAD`)
followed by its *segments* (``FLAG_SEGMENT``), each an ordinary frame --
its own sequence number, header MAC and body tag -- of at most one segment.
So no frame on the wire is bigger than a segment, and a message may be
bigger than ``max_frame`` (up to ``max_message``). The receiver checks the
lead like any header, bounds its claims before anything is allocated, then
reads each segment, checked the same way, straight to its place in one
buffer of the whole body: a segmented message costs the memory a single
frame of it would, with no copy and no list of segments. docs/wire.md §2.4
is the byte-level spec; every byte of each frame is still decided by
``_channel``, which this module drives.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np

from meshkit.errors import WireError
from meshkit.wire._buffers import _message_buffer
from meshkit.wire._codec import FLAG_SEGMENT, FLAG_SEGMENTED, HEADER_SIZE, SEGMENT_LEAD

#: Largest message (a segmented body, all its segments together) a channel
#: accepts unless told otherwise (1 TiB): checked against a lead frame's
#: claim before the body's buffer is allocated.
DEFAULT_MAX_MESSAGE = 1 << 40


def cut(views: list[memoryview], size: int) -> Iterator[tuple[list[memoryview], int]]:
    """``(views, nbytes)`` pieces of ``size`` bytes of the body ``views`` make (the last: the rest).

    A piece spanning buffers is a list of slices of each: nothing is copied.
    """
    piece: list[memoryview] = []
    have = 0
    for view in views:
        start = 0
        while start < view.nbytes:
            take = min(size - have, view.nbytes - start)
            piece.append(view[start:start + take])
            have += take
            start += take
            if have == size:
                yield piece, have
                piece, have = [], 0
    if have:
        yield piece, have


def write_segmented(channel: Any, kind: int, flags: int, tag: int, sender: int,
                    views: list[memoryview], nbytes: int, segment: int,
                    deadline: float | None) -> None:
    """Write a body above one segment: its lead frame, then its segments, back to back.

    ``channel`` is a :class:`~meshkit.wire.Channel` whose send lock the
    caller holds throughout, so no other frame comes between them.
    """
    count = -(-nbytes // segment)
    lead = memoryview(SEGMENT_LEAD.pack(nbytes, count, segment))
    channel._write_frame(kind, flags | FLAG_SEGMENTED, tag, sender, [lead], lead.nbytes,
                         deadline)
    for piece, size in cut(views, segment):
        channel._write_frame(kind, FLAG_SEGMENT, tag, sender, piece, size, deadline)


def read_segmented(channel: Any, header: bytes, kind: int, tag: int, sender: int, seq: int,
                   nbytes: int) -> tuple[np.ndarray, int]:
    """Read a lead frame's body and the segments it announces: ``(body, segments)``.

    ``channel`` (a :class:`~meshkit.wire.Channel`, its receive lock held)
    has checked the lead's header. The lead's claims (size, count, segment
    size) are checked against this end's bounds before the body's buffer
    exists; each segment is then a frame checked like any other (MAC,
    sequence number, the lead's kind, tag and sender, its exact length) and
    read, decrypted and verified straight at its offset.
    """
    who = channel.peer.describe()
    if nbytes != SEGMENT_LEAD.size:
        raise WireError(f"{who} sent a lead frame of {nbytes} bytes, expected "
                        f"{SEGMENT_LEAD.size}; the stream is out of sync")
    lead = bytearray(SEGMENT_LEAD.size)
    channel._read_body(header, seq, tag, memoryview(lead))
    total, count, size = SEGMENT_LEAD.unpack(lead)
    check_layout(who, channel, total, count, size)
    body = _message_buffer(total)
    read_segments(channel, kind, tag, sender, total, count, size, body.data, 0)
    return body, count


def check_layout(who: str, channel: Any, total: int, count: int, size: int) -> None:
    """Bound a message's announced size, segment count and segment size (before any buffer)."""
    if not 0 < size <= channel.max_frame:
        raise WireError(f"{who} announced segments of {size} bytes; this node takes "
                        f"1 to {channel.max_frame} (its max_frame)")
    if total > channel.max_message:
        raise WireError(f"{who} announced a message of {total} bytes, above this node's "
                        f"max_message of {channel.max_message}; refused before reading it")
    if total == 0 or count != -(-total // size):
        raise WireError(f"{who} announced {count} segments of {size} bytes for a "
                        f"{total}-byte message; the stream is out of sync")


def read_segments(channel: Any, kind: int, tag: int, sender: int, total: int, count: int,
                  size: int, view: memoryview, first: int,
                  verified: Callable[[int, memoryview], None] | None = None) -> None:
    """Read segments ``first .. count - 1`` of a message straight to their offsets in ``view``.

    Each is a frame checked like any other (MAC, sequence number, the lead's
    kind, tag and sender, its exact length, its tag) before ``verified(index,
    its bytes)`` is told of it.
    """
    who = channel.peer.describe()
    header_buf = bytearray(HEADER_SIZE)
    for index in range(first, count):
        start = index * size
        channel._read_into(memoryview(header_buf), "header")
        s_kind, s_flags, s_tag, s_sender, s_seq, s_bytes = channel._check_header(header_buf)
        expected = min(size, total - start)
        if (s_flags != FLAG_SEGMENT or s_kind != kind or s_tag != tag
                or s_sender != sender or s_bytes != expected):
            raise WireError(
                f"{who}: frame {index + 1} of a {count}-segment message (tag 0x{tag:08X}) "
                f"is not its segment {index + 1} (flags {s_flags:#x}, tag 0x{s_tag:08X}, "
                f"{s_bytes} bytes, expected {expected}); the stream is out of sync")
        piece = view[start:start + expected]
        channel._read_body(bytes(header_buf), s_seq, tag, piece)
        if verified is not None:
            verified(index, piece)
