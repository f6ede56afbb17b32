"""A cut transfer resumes: what the sender keeps, what it offers after a reconnect, where it continues.

A message sent with :meth:`Channel.send_resumable` travels as a *resumable*
segmented message (docs/wire.md §2.5): its lead names a transfer id. When
the connection is cut part-way, the receiver parks what it verified
(``_partials``); after a reconnect the sender offers the transfer (its id,
layout and the digest of its whole body) in the new handshake
(:func:`exchange_offers`), the receiver answers with the first segment it
still needs, and the sender continues from there. The receiver checks the
whole body against the offer's digest at the end: a mismatch is a
:class:`~meshkit.errors.DigestMismatchError` and the partial is discarded.
Every segment is still an ordinary frame, authenticated on the connection
that carried it; the digest binds the pieces of two connections into one
message (a checksum against a sender whose body changed between the
attempts, not a MAC: the frames are the MACs). So only a resumed transfer
pays for it: the sender digests the body when it offers it, the receiver
once the last segment is in; a transfer that is never cut costs one 40-byte
lead more than a plain segmented one.

The digest is AES-GMAC (16 bytes) under ``SHA256("meshkit/5 resume digest"
|| id)`` with an all-zero nonce, the body as associated data: it runs at
the body tag's speed (GiB/s), where SHA-256 ran at about 240 MiB/s on the
benchmark machine.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from meshkit.errors import ConfigError, DigestMismatchError, PeerLostError, WireError
from meshkit.wire._codec import (
    FLAG_BF16,
    FLAG_RESUMABLE,
    FLAG_RESUME,
    FLAG_SEGMENT,
    FLAG_SEGMENTED,
    HEADER_SIZE,
    RESUME_ANSWER,
    RESUME_COUNT,
    RESUME_LEAD,
    RESUME_OFFER,
    EncodedState,
    _byte_view,
    encode_state,
)
from meshkit.wire._partials import (
    COMPLETED,
    RESUMED,
    STATUS_TEXT,
    UNKNOWN,
    Partial,
    PartialStore,
)
from meshkit.wire._segments import check_layout, cut, read_segments

#: Most transfers one handshake may offer (an offer is bounded before it is read).
MAX_OFFERS = 64
_ID_SIZE = 16
_PIECE = 1 << 30  # GMAC takes at most 2**31 - 1 bytes of associated data per call


def _digest_context(transfer_id: bytes) -> Any:
    key = hashlib.sha256(b"meshkit/5 resume digest" + transfer_id).digest()
    return Cipher(algorithms.AES(key), modes.GCM(bytes(12))).encryptor()


def _feed(context: Any, view: memoryview) -> None:
    for start in range(0, view.nbytes, _PIECE):
        context.authenticate_additional_data(view[start:start + _PIECE])


def body_digest(transfer_id: bytes, views: Sequence[memoryview]) -> bytes:
    """The 16-byte digest of a body (its buffers in order) for transfer ``transfer_id``."""
    context = _digest_context(transfer_id)
    for view in views:
        _feed(context, view)
    context.finalize()
    return bytes(context.tag)


@attrs.define(eq=False)
class Answer:
    """What the receiver answered to one offered transfer: where to continue, and why."""

    first: int
    status: int

    @property
    def reason(self) -> str:
        return STATUS_TEXT.get(self.status, f"status {self.status}")


@attrs.define(eq=False)
class Transfer:
    """A message that can resume where a cut left it.

    Keep it until :meth:`Channel.send_resumable` returns; if that raised
    :class:`~meshkit.errors.PeerLostError`, reconnect with
    ``handshake(..., offers=[transfer])`` and send it again on the new
    channel: it continues from the receiver's answer. ``encoded`` should
    not change in between: a change in the part the receiver already holds
    is a :class:`~meshkit.errors.DigestMismatchError` at its end.
    """

    encoded: EncodedState
    id: bytes = attrs.field(factory=lambda: os.urandom(_ID_SIZE))
    #: Segment size of its first segmented send (0: not sent segmented yet).
    size: int = 0
    #: Sent to the end (the last send returned).
    complete: bool = False
    #: The segment the last send started from (0: from the beginning).
    resumed_from: int = 0
    #: The receiver's answer to the last offer of it, or None.
    answer: Answer | None = None

    @classmethod
    def of(cls, state: Any, *, bf16: bool = False) -> Transfer:
        """A transfer of ``state``, encoded once (as :func:`encode_state`)."""
        return cls(encode_state(state, bf16=bf16))

    def digest(self) -> bytes:
        """The whole body's digest as it is now (one pass over it: computed per offer)."""
        return body_digest(self.id, [_byte_view(b) for b in self.encoded.buffers])

    @property
    def count(self) -> int:
        return -(-self.encoded.nbytes // self.size) if self.size else 0

    def offerable(self) -> bool:
        """Sent segmented at least once: worth offering after a reconnect.

        Not only when a send raised: a send the kernel took whole may still
        have been cut on the way, and only the receiver knows (it answers
        COMPLETED for a transfer it received whole, and it is not sent again).
        """
        return self.size > 0


def _skip(views: list[memoryview], offset: int) -> Iterator[memoryview]:
    for view in views:
        if offset >= view.nbytes:
            offset -= view.nbytes
            continue
        yield view[offset:]
        offset = 0


def send_transfer(channel: Any, kind: int, tag: int, transfer: Transfer, sender: int,
                  deadline: float | None) -> int:
    """Send ``transfer`` on ``channel``, from the segment the handshake's answer names; bytes sent.

    A body that fits one segment on a fresh send is an ordinary frame (a cut
    then sends it again whole: it is one segment at most). A transfer the
    receiver answered COMPLETED is not sent (0 bytes). A continuation
    keeps the segment size the transfer started with (the receiver's answer
    checked it against its bounds).
    """
    encoded = transfer.encoded
    answer = channel.resume_answers.pop(transfer.id, None)
    transfer.answer = answer
    first = answer.first if answer is not None and transfer.size else 0
    if answer is not None and answer.status == COMPLETED:
        transfer.complete, transfer.resumed_from = True, transfer.count
        return 0  # the receiver has it whole: sending it again would deliver it twice
    if first == 0:
        if encoded.nbytes <= channel.segment_bytes:
            sent = channel.send_encoded(kind, tag, encoded, sender=sender, deadline=deadline)
            transfer.complete, transfer.resumed_from = True, 0
            return int(sent)
        transfer.size = channel.segment_bytes  # a fresh start cuts at this link's size
    size, count, nbytes = transfer.size, transfer.count, encoded.nbytes
    if not (0 <= kind <= 0xFF and 0 <= tag <= 0xFFFFFFFF and 0 <= sender <= 0xFFFFFFFF):
        raise WireError(f"frame kind, tag or sender out of range: {kind}, {tag}, {sender}")
    lead = memoryview(RESUME_LEAD.pack(nbytes, count, size, transfer.id, first, 0))
    views = [_byte_view(buf) for buf in encoded.buffers]
    transfer.complete, transfer.resumed_from = False, first
    with channel._send_lock:
        if channel.closed:
            raise channel._closed_error("is")
        try:
            channel._write_frame(kind, encoded.flags | FLAG_SEGMENTED | FLAG_RESUMABLE, tag,
                                 sender, [lead], lead.nbytes, deadline)
            for piece, piece_bytes in cut(list(_skip(views, first * size)), size):
                channel._write_frame(kind, FLAG_SEGMENT, tag, sender, piece, piece_bytes,
                                     deadline)
        except BaseException as exc:
            channel.close(str(exc) if isinstance(exc, PeerLostError) else None)
            raise
    transfer.complete = True
    return nbytes - first * size


def read_resumable(channel: Any, header: bytes, kind: int, flags: int, tag: int, sender: int,
                   seq: int, nbytes: int) -> tuple[np.ndarray, int, int]:
    """Read a resumable lead and its segments: ``(body, segments read, first segment)``.

    A fresh transfer (first segment 0) starts a partial; a continuation must
    be the one this connection's handshake answered, with the same layout,
    kind, tag and sender. Cut part-way (:class:`PeerLostError`), the
    partial is parked in the channel's store; at the end of a continuation
    the whole body is checked against the digest its offer announced.
    """
    who = channel.peer.describe()
    if nbytes != RESUME_LEAD.size:
        raise WireError(f"{who} sent a resumable lead of {nbytes} bytes, expected "
                        f"{RESUME_LEAD.size}; the stream is out of sync")
    lead = bytearray(RESUME_LEAD.size)
    channel._read_body(header, seq, tag, memoryview(lead))
    total, count, size, tid, first, reserved = RESUME_LEAD.unpack(lead)
    check_layout(who, channel, total, count, size)
    body_flags = flags & FLAG_BF16
    if reserved or first >= count:
        raise WireError(f"{who} sent a resumable lead starting at segment {first} of {count} "
                        f"(reserved {reserved}); the stream is out of sync")
    store: PartialStore | None = channel.partials
    if first == 0:
        channel.resuming.pop(tid, None)  # the sender started it over
        if store is not None:
            store.discard(tid, channel.peer.rank, channel.peer_key)
        partial = Partial(id=tid, total=total, count=count, size=size, kind=kind, tag=tag,
                          sender=sender, flags=body_flags, peer_rank=channel.peer.rank,
                          peer_key=channel.peer_key, body=np.empty(total, dtype=np.uint8))
    else:
        partial = channel.resuming.pop(tid, None)
        if partial is None or partial.done != first:
            held = "no partial" if partial is None else f"segment {partial.done}"
            raise WireError(f"{who} continues transfer {tid.hex()} from segment {first}, but "
                            f"this connection's handshake answered it with {held}")
        if ((partial.total, partial.count, partial.size, partial.kind, partial.tag,
             partial.sender, partial.flags)
                != (total, count, size, kind, tag, sender, body_flags)):
            raise WireError(f"{who} continues transfer {tid.hex()} with another size, kind, "
                            f"tag, flags or sender than it started with; refused")

    def verified(index: int, piece: memoryview) -> None:
        partial.done = index + 1

    try:
        read_segments(channel, kind, tag, sender, total, count, size, partial.body.data, first,
                      verified)
    except PeerLostError:
        if store is not None:
            store.park(partial)
        raise
    if first and body_digest(tid, [partial.body.data]) != partial.digest:
        raise DigestMismatchError(
            f"{who}: transfer {tid.hex()} ({total} bytes, resumed at segment {first} of "
            f"{count}) does not match the digest its offer announced: the sender's body changed "
            f"between the attempts; the partial is discarded, send it again from the start")
    if store is not None:
        store.completed(tid, channel.peer.rank, channel.peer_key)
    return partial.body, count - first, first


# -- the offer and its answer, right after the handshake ---------------------------------------


def exchange_offers(channel: Any, offers: Sequence[Transfer], partials: PartialStore | None,
                    peer_offers: bool, *, offering: bool | None = None) -> None:
    """Offer this end's cut transfers and answer the peer's (both ends, in the same order).

    Each end first writes its offer (if its hello said so), then answers the
    peer's, then reads the answer to its own: the frames are small, so
    neither end waits on the other's reading. Answers land in
    ``channel.resume_answers`` (by transfer id); claimed partials in
    ``channel.resuming``, until their continuation arrives. ``offering``
    (default: whether there are ``offers``) is what this end's hello said:
    an end that said so sends its offer even of no transfers.
    """
    if offering is None:
        offering = bool(offers)
    if offering:
        body = RESUME_COUNT.pack(len(offers), 0) + b"".join(
            RESUME_OFFER.pack(t.id, t.digest(), t.encoded.nbytes, t.count, t.size) for t in offers)
        _write_control(channel, body)
    if peer_offers:
        answers = []
        for tid, digest, total, count, size in _read_offer(channel):
            partial, status = (None, UNKNOWN) if partials is None else partials.claim(
                tid, digest, total, count, size, channel.peer.rank, channel.peer_key)
            if partial is not None:
                channel.resuming[tid] = partial
            answers.append(RESUME_ANSWER.pack(tid, 0 if partial is None else partial.done,
                                              status))
        _write_control(channel, RESUME_COUNT.pack(len(answers), 0) + b"".join(answers))
    if offering:
        channel.resume_answers.update(_read_answer(channel, offers))


def _write_control(channel: Any, body: bytes) -> None:
    with channel._send_lock:
        channel._write_frame(0, FLAG_RESUME, 0, channel.rank, [memoryview(body)], len(body), None)


def _read_control(channel: Any, what: str, entry: int) -> tuple[bytes, int]:
    """Read the peer's offer or answer frame, its length bounded before it is read."""
    who = channel.peer.describe()
    header = bytearray(HEADER_SIZE)
    channel._read_into(memoryview(header), "header")
    _kind, flags, tag, _sender, seq, nbytes = channel._check_header(header, allow=FLAG_RESUME)
    most = RESUME_COUNT.size + MAX_OFFERS * entry
    if flags != FLAG_RESUME or not RESUME_COUNT.size <= nbytes <= most or (
            nbytes - RESUME_COUNT.size) % entry:
        raise WireError(f"{who} sent a frame of {nbytes} bytes (flags {flags:#x}) where its "
                        f"resume {what} belongs (flags {FLAG_RESUME:#x}, {RESUME_COUNT.size} "
                        f"+ {entry} bytes per transfer, at most {MAX_OFFERS}); refused")
    body = bytearray(nbytes)
    channel._read_body(bytes(header), seq, tag, memoryview(body))
    count, reserved = RESUME_COUNT.unpack_from(body)
    if reserved or count != (nbytes - RESUME_COUNT.size) // entry:
        raise WireError(f"{who}'s resume {what} claims {count} transfers in "
                        f"{nbytes} bytes (reserved {reserved}); refused")
    return bytes(body), count


def _read_offer(channel: Any) -> list[tuple[bytes, bytes, int, int, int]]:
    body, count = _read_control(channel, "offer", RESUME_OFFER.size)
    who = f"{channel.peer.describe()}'s resume offer"
    entries = [RESUME_OFFER.unpack_from(body, RESUME_COUNT.size + i * RESUME_OFFER.size)
               for i in range(count)]
    for tid, _digest, total, n, size in entries:
        check_layout(f"{who} (transfer {tid.hex()})", channel, total, n, size)
    if len({e[0] for e in entries}) != len(entries):
        raise WireError(f"{who} names a transfer twice; refused")
    return entries


def _read_answer(channel: Any, offers: Sequence[Transfer]) -> dict[bytes, Answer]:
    body, count = _read_control(channel, "answer", RESUME_ANSWER.size)
    who = f"{channel.peer.describe()}'s resume answer"
    if count != len(offers):
        raise WireError(f"{who} answers {count} transfers, {len(offers)} were offered")
    out = {}
    for i, transfer in enumerate(offers):
        tid, first, status = RESUME_ANSWER.unpack_from(body, RESUME_COUNT.size
                                                       + i * RESUME_ANSWER.size)
        if tid != transfer.id or status not in STATUS_TEXT or (status == RESUMED) != (
                first > 0) or first >= transfer.count:
            raise WireError(f"{who} is not an answer to transfer {transfer.id.hex()} of "
                            f"{transfer.count} segments (id {tid.hex()}, segment {first}, "
                            f"status {status}); refused")
        out[tid] = Answer(first=first, status=status)
    return out


def check_offers(offers: Sequence[Transfer]) -> list[Transfer]:
    """The transfers worth offering (sent segmented), at most :data:`MAX_OFFERS`."""
    keep = [t for t in offers if t.offerable()]
    if len(keep) > MAX_OFFERS:
        raise ConfigError(f"a handshake offers at most {MAX_OFFERS} cut transfers, "
                          f"got {len(keep)}; offer the rest on another connection")
    return keep
