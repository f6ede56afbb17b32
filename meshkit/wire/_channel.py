"""Every byte a frame puts on the socket is decided here.

A :class:`Channel` is what :func:`~meshkit.wire.handshake` returns: one
connected socket and its per-direction keys. Sending packs the header (kind,
flags, tag, sender, sequence number, body length), MACs it with HMAC-SHA256,
then sends the body AES-256-GCM encrypted (the header is the associated
data, the nonce the sequence number) piece by piece straight from the arrays'
memory, and ends with the 16-byte GCM tag. With encryption off the body
travels in clear, followed by the GCM tag of the header with the body as
associated data (AES-GMAC). Receiving reads the header alone, checks its
MAC, sequence number, flags and length *before* a body-sized buffer exists,
then reads the body into that buffer, decrypting it in place (or feeding it
to the tag) piece by piece while the bytes are still in cache, and checks
the tag before anything is decoded. A receiver that knows what the next
frames must hold (the mesh all-reduce's ring) can hand :meth:`Channel.recv`
a :class:`Placer`: a body that starts with one of the heads it expects is
then read (and decrypted, or fed to the tag) straight into the buffer that
head names, not into a receive buffer to be copied from. A body above the
link's segment size travels as a lead frame and segments, each a frame
sent and checked here (how it is cut and put back: ``_segments``). Stall timeouts and write deadlines are enforced here; any
error but :class:`RecvTimeout` closes the channel, since the stream can no
longer be trusted to be in sync. The layouts themselves are in ``_codec``.
"""

from __future__ import annotations

import hmac
import socket
import struct
import threading
import time
from typing import Any, Mapping, Protocol

import attrs
import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from meshkit.errors import AuthenticationError, ConfigError, PeerLostError, WireError
from meshkit.wire._buffers import (
    _SEND_PIECE,
    _give_scratch,
    _receive_buffer,
    _take_scratch,
    _thread_buffer,
)
from meshkit.wire._codec import (
    _HEADER,
    _KNOWN_HEADER_FLAGS,
    BODY_TAG_SIZE,
    DEFAULT_SEGMENT_BYTES,
    FLAG_BF16,
    FLAG_RESUMABLE,
    FLAG_SEGMENT,
    FLAG_SEGMENTED,
    FRAME_MAGIC,
    HEADER_SIZE,
    MAC_SIZE,
    EncodedState,
    Hello,
    _byte_view,
    decode_state,
    encode_state,
)
from meshkit.wire._keys import _Keys
from meshkit.wire._partials import PartialStore
from meshkit.wire._resume import Transfer, read_resumable, send_transfer
from meshkit.wire._segments import DEFAULT_MAX_MESSAGE, read_segmented, write_segmented
from meshkit.wire._sockets import _Poller, _send_queue_has_room, close_socket

#: Largest frame body a channel accepts unless told otherwise (1 GiB).
DEFAULT_MAX_FRAME = 1 << 30
_ZERO_MAC = bytes(MAC_SIZE)
_ZERO_TAG = bytes(BODY_TAG_SIZE)
# 96-bit GCM nonce: 4 zero bytes then the frame's u64 sequence number. The key
# is per connection and per direction and the sequence number never repeats
# in a direction, so a (key, nonce) pair is never reused.
_GCM_NONCE = struct.Struct("<IQ")
# AESGCM's one-shot call takes at most 2**31 - 1 bytes of associated data;
# bigger bodies (max_frame can be raised past 2 GiB) are fed in pieces.
_AAD_PIECE = 1 << 30
# AESGCM.encrypt_into/decrypt_into (cryptography 46+) seal a small frame in a
# kept buffer and open a small body into its receive buffer; older releases
# return new bytes, copied.
_AEAD_INTO = hasattr(AESGCM, "encrypt_into") and hasattr(AESGCM, "decrypt_into")

# A whole frame this small is built in one buffer and sent with one call; big
# buffers go straight from the array's memory (no concatenation copy).
_COALESCE = 256 * 1024
# Big bodies are authenticated piecewise, each piece right before it is sent
# or right after it arrived, while it is still in cache: one pass over memory.
# The pieces also pipeline the two ends: the receiver copies and checks one
# piece while the sender tags the next. Received bytes are fed to the tag
# every _MAC_STEP; a body is sent in halves up to _SEND_PIECE each, so even a
# 1 MiB frame overlaps (docs/benchmarks/allreduce.md: the MAC's share of a
# 1 MiB ping-pong fell from about 100 % to about 25 % with this).
_MAC_STEP = 256 << 10
_RECV_CHUNK = 4 << 20
_SEND_CHUNK = 4 << 20


def _streaming_gmac(key: bytes, seq: int) -> Any:
    """A GCM encryptor to feed the body to (``authenticate_additional_data``),
    then the header (``update``); ``finalize()`` then ``.tag`` is the body tag."""
    return Cipher(algorithms.AES(key), modes.GCM(_GCM_NONCE.pack(0, seq))).encryptor()


def _streaming_gcm(key: bytes, seq: int, header: bytes, *, decrypt: bool = False) -> Any:
    """A GCM encryptor (or decryptor) with ``header`` as associated data, for the body."""
    cipher = Cipher(algorithms.AES(key), modes.GCM(_GCM_NONCE.pack(0, seq)))
    context = cipher.decryptor() if decrypt else cipher.encryptor()
    context.authenticate_additional_data(header)
    return context


def _body_tag(gcm: AESGCM, key: bytes, seq: int, header: bytes, body: list[memoryview]) -> bytes:
    """The GCM tag of ``header`` (plaintext) with ``body`` as associated data.

    GMAC authenticates at tens of GiB/s (AES-NI + carry-less multiply), where
    SHA-256 manages under 2 GiB/s; encrypting the header binds it (kind, tag,
    sender, seq, length) to the body. Only the tag is sent; the ciphertext is
    discarded. Equals ``AESGCM(key).encrypt(nonce, header, body)[-16:]``.
    """
    nonce = _GCM_NONCE.pack(0, seq)
    if len(body) == 1 and body[0].nbytes <= _AAD_PIECE:
        return gcm.encrypt(nonce, header, body[0])[-BODY_TAG_SIZE:]
    # Scattered buffers (or a huge body): the streaming form, no concatenation.
    encryptor = _streaming_gmac(key, seq)
    for view in body:
        for start in range(0, view.nbytes, _AAD_PIECE):
            encryptor.authenticate_additional_data(view[start:start + _AAD_PIECE])
    encryptor.update(header)
    encryptor.finalize()
    return encryptor.tag


class Placer(Protocol):
    """Where the bodies of expected frames go: straight into the receiver's own buffers.

    :meth:`Channel.recv` asks :meth:`head_size` once a frame's header is
    authenticated and its length bounded; a nonzero answer ``h`` makes it
    read the body's first ``h`` bytes (decrypted when encryption is on) and
    pass them to :meth:`place`. Those bytes are **not yet authenticated**:
    they only select, by exact equality with a head the receiver itself
    computed, one of the receiver's own destinations; they never say where
    bytes go. ``place`` returns ``(target, state)``: the rest of the body
    (exactly ``target.nbytes`` bytes, else the frame is received as usual)
    is read into ``target``, a writable C-contiguous array, and once the
    tag is checked the frame's ``state`` is the given ``state`` (which
    should refer to ``target``). None receives the frame as usual. A frame
    whose tag fails is an :class:`AuthenticationError` as always, and
    ``target`` then holds unauthenticated bytes: the caller must treat its
    contents as lost (the channel is closed).
    """

    def head_size(self, tag: int, flags: int, nbytes: int) -> int:
        """How many leading body bytes decide where the rest goes (0: receive as usual)."""
        ...

    def place(self, head: bytes) -> tuple[np.ndarray, dict[str, Any]] | None:
        """The buffer for the rest of the body and the state it stands for, or None."""
        ...


class RecvTimeout(PeerLostError):
    """No frame started within the receive timeout; the channel is still usable."""


@attrs.frozen
class Frame:
    """One authenticated frame as received."""

    kind: int
    tag: int
    sender: int
    seq: int
    state: dict[str, Any]
    bf16: bool = False
    #: The body's size: the whole message's, for a segmented one.
    nbytes: int = 0
    #: The raw body (a numpy uint8 array the state's arrays are views of).
    body: Any = attrs.field(default=None, repr=False, eq=False)
    flags: int = 0
    #: True when a :class:`Placer` took the body: ``state`` is the one it
    #: gave, its data already in place; ``body`` is None (nothing to forward).
    placed: bool = False
    #: How many segments the body came in (0: one ordinary frame).
    segments: int = 0
    #: The segment a resumed transfer continued from on this connection (0: none).
    resumed_from: int = 0


_UNSET: Any = object()


class Channel:
    """An authenticated, sequenced frame stream over one connected socket.

    Build one with :func:`handshake`. ``timeout`` is a stall timeout: a read
    or write that makes no progress for that many seconds drops the peer
    with :class:`PeerLostError`; a large frame that keeps moving is never cut
    off. Any error other than :class:`RecvTimeout` closes the channel, since
    the stream can no longer be trusted to be in sync.
    """

    def __init__(self, sock: socket.socket, *, keys: _Keys, rank: int, world: int, peer: Hello,
                 timeout: float, max_frame: int, mac: bool = True, encrypt: bool = False,
                 peer_key: bytes | None = None, segment: int = DEFAULT_SEGMENT_BYTES,
                 max_message: int = DEFAULT_MAX_MESSAGE,
                 partials: PartialStore | None = None) -> None:
        self._sock = sock
        self._keys = keys
        self.rank = rank
        self.world = world
        self.peer = peer
        self._timeout = timeout
        self.max_frame = max_frame
        self.mac_enabled = mac
        #: Whether bodies travel AES-256-GCM encrypted (agreed in the handshake).
        self.encrypted = encrypt and mac
        #: The Ed25519 public key the peer proved in the handshake (32 bytes), or None.
        self.peer_key = peer_key
        #: The largest segment this end asked for in its hello (bytes).
        self.segment = segment
        #: The largest message (a segmented body) this end accepts (bytes).
        self.max_message = max_message
        #: Where a resumable message cut on this channel is parked (None: dropped).
        self.partials = partials
        #: Partials this connection's handshake claimed for their continuation (by id).
        self.resuming: dict[bytes, Any] = {}
        #: The peer's answers to the transfers this end offered in the handshake (by id).
        self.resume_answers: dict[bytes, Any] = {}
        #: The largest frame body this channel wrote and read (tests, benchmarks).
        self.largest_sent = 0
        self.largest_received = 0
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._send_seq = 0
        self._recv_seq = 0
        self._closed = False
        self._close_reason: str | None = None
        # The socket is non-blocking and the channel polls only when a read or
        # write would block: with a socket timeout set, CPython polls before
        # *every* recv/send, and a small frame paid five syscalls instead of two.
        # One poll object per direction: a poll object refuses concurrent use.
        sock.setblocking(False)
        self._read_poll = _Poller(sock)
        self._write_poll = _Poller(sock, write=True)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (f"<Channel rank {self.rank} <-> {self.peer.describe()}, {state}, "
                f"sent {self._send_seq}, received {self._recv_seq}>")

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def segment_bytes(self) -> int:
        """The most one frame of a message carries on this link (a bigger body is
        segmented): the smallest of both ends' hello ``segment`` and ``max_frame``."""
        theirs = self.peer.segment or self.segment
        return min(self.segment, theirs, self.max_frame, self.peer.max_frame)

    @property
    def timeout(self) -> float:
        """Stall timeout in seconds for reads and writes (settable)."""
        return self._timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        if not seconds > 0:
            raise ConfigError(f"a channel timeout must be positive seconds, got {seconds}")
        self._timeout = seconds

    def fileno(self) -> int:
        return self._sock.fileno()

    def close(self, reason: str | None = None) -> None:
        """Close the socket; a thread blocked in :meth:`recv` wakes with PeerLostError.

        ``reason`` (the first one given wins) is quoted by the errors other
        threads then get, so a reader that wakes to a channel a failed write
        closed reports why, not just that it was closed.
        """
        if reason is not None and self._close_reason is None:
            self._close_reason = reason
        self._closed = True
        close_socket(self._sock)
        # Partials claimed by the handshake and never continued go back to the store.
        while self.resuming and self.partials is not None:
            self.partials.park(self.resuming.popitem()[1])

    def _closed_error(self, tense: str = "was") -> PeerLostError:
        why = f" ({self._close_reason})" if self._close_reason else ""
        return PeerLostError(f"channel to {self.peer.describe()} {tense} closed{why}")

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sending ---------------------------------------------------------------------------

    def send(self, kind: int, tag: int, state: Mapping[str, Any], *, bf16: bool = False,
             sender: int | None = None, deadline: float | None = None) -> int:
        """Send one frame; returns the body size in bytes.

        ``kind`` (0..255) and ``tag`` (0..2**32-1) are the transport's to
        interpret. ``sender`` defaults to this end's rank (a relay passes the
        original sender). With ``bf16``, float32 arrays travel as bfloat16.
        ``deadline`` (``time.monotonic()`` seconds) bounds the whole write on
        top of the stall timeout: a peer that reads, but too slowly, is a
        :class:`PeerLostError` once it passes, and the channel is closed.
        """
        return self.send_encoded(kind, tag, encode_state(state, bf16=bf16), sender=sender,
                                 deadline=deadline)

    def send_encoded(self, kind: int, tag: int, encoded: EncodedState, *,
                     sender: int | None = None, deadline: float | None = None) -> int:
        """Send a body prepared by :func:`encode_state` (encode once, scatter to many)."""
        sent = self._send_buffers(kind, tag, encoded.flags, encoded,
                                  self.rank if sender is None else sender, deadline)
        assert sent is not None  # only forward_now (if_room) may send nothing
        return sent

    def send_resumable(self, kind: int, tag: int, transfer: Transfer, *,
                       sender: int | None = None, deadline: float | None = None) -> int:
        """Send ``transfer`` so that a cut resumes: from the start, or where the
        handshake's answer to its offer says; returns the body bytes sent now.

        Keep ``transfer`` until this returns; after a :class:`PeerLostError`,
        reconnect with ``handshake(..., offers=[transfer])`` and call this on
        the new channel (docs/wire.md §2.5).
        """
        return send_transfer(self, kind, tag, transfer, self.rank if sender is None else sender,
                             deadline)

    def forward(self, frame: Frame, *, sender: int | None = None,
                deadline: float | None = None) -> int:
        """Re-send a received frame's body unchanged (for relays: no re-encoding).

        The body tag is recomputed under this channel's key and sequence
        number: tags are per connection and per direction.
        """
        encoded = EncodedState(buffers=(frame.body,), nbytes=frame.nbytes, flags=frame.flags)
        sent = self._send_buffers(frame.kind, frame.tag, frame.flags, encoded,
                                  frame.sender if sender is None else sender, deadline)
        assert sent is not None  # only forward_now (if_room) may send nothing
        return sent

    def forward_now(self, frame: Frame, *, sender: int | None = None) -> bool:
        """Forward ``frame`` (as :meth:`forward`) only if that cannot wait on the peer.

        Returns True once the frame is written, or False, having written
        nothing, when the send lock is busy or the kernel's send buffer might
        not take the whole frame at once. A relay calls this on the thread
        that reads from the *sender*: that thread must never wait for a
        destination that has stopped reading, so on False it hands the frame
        to a thread that may wait.
        """
        encoded = EncodedState(buffers=(frame.body,), nbytes=frame.nbytes, flags=frame.flags)
        sent = self._send_buffers(frame.kind, frame.tag, frame.flags, encoded,
                                  frame.sender if sender is None else sender, if_room=True)
        return sent is not None

    def _send_buffers(self, kind: int, tag: int, flags: int, encoded: EncodedState,
                      sender: int, deadline: float | None = None, *,
                      if_room: bool = False) -> int | None:
        # ``if_room``: send only if it cannot wait (see forward_now); None if not sent.
        nbytes = encoded.nbytes
        if not 0 <= kind <= 0xFF:
            raise WireError(f"frame kind must be 0..255, got {kind}")
        if not 0 <= tag <= 0xFFFFFFFF:
            raise WireError(f"frame tag must be 0..0xFFFFFFFF, got {tag!r}")
        if not 0 <= sender <= 0xFFFFFFFF:
            raise WireError(f"frame sender must be a rank >= 0, got {sender}")
        # _byte_view written out: a call a buffer (19 a digits request) fewer (issue 36).
        views = [v if (v := memoryview(buf)).format == "B" and v.ndim == 1 else v.cast("B")
                 for buf in encoded.buffers]
        if not self._send_lock.acquire(blocking=not if_room):
            return None
        try:
            if self._closed:
                raise self._closed_error("is")
            if if_room and not _send_queue_has_room(
                    self._sock, HEADER_SIZE + nbytes + BODY_TAG_SIZE):
                return None
            try:
                if nbytes <= self.segment_bytes:
                    self._write_frame(kind, flags, tag, sender, views, nbytes, deadline)
                else:
                    write_segmented(self, kind, flags, tag, sender, views, nbytes,
                                    self.segment_bytes, deadline)
            except BaseException as exc:
                self.close(str(exc) if isinstance(exc, PeerLostError) else None)
                raise
        finally:
            self._send_lock.release()
        return nbytes

    def _write_frame(self, kind: int, flags: int, tag: int, sender: int,
                     views: list[memoryview], nbytes: int, deadline: float | None) -> None:
        """One frame: header (MACed), body, tag; the next sequence number (send lock held)."""
        seq = self._send_seq
        head = _HEADER.pack(FRAME_MAGIC, kind, flags, 0, tag, sender, seq, nbytes)
        header = head + (self._keys.send_mac(head) if self.mac_enabled else _ZERO_MAC)
        self._write(header, views, nbytes, seq, deadline)
        self._send_seq = seq + 1
        if nbytes > self.largest_sent:
            self.largest_sent = nbytes

    def _tag(self, seq: int, header: bytes, body: list[memoryview]) -> bytes:
        if not self.mac_enabled:
            return _ZERO_TAG
        return _body_tag(self._keys.send_gcm, self._keys.send_body, seq, header, body)

    def _write(self, header: bytes, views: list[memoryview], nbytes: int, seq: int,
               deadline: float | None) -> None:
        if self.encrypted:
            self._write_encrypted(header, views, nbytes, seq, deadline)
            return
        if nbytes < _COALESCE:
            # Small frame: built in the thread's buffer, one tag call over it, one send.
            frame = _thread_buffer(HEADER_SIZE + nbytes + BODY_TAG_SIZE)
            frame[:HEADER_SIZE] = header
            end = HEADER_SIZE
            for view in views:
                frame[end:end + view.nbytes] = view
                end += view.nbytes
            frame[end:] = self._tag(seq, header, [frame[HEADER_SIZE:end]])
            self._send_all(frame, deadline)
            return
        gmac = _streaming_gmac(self._keys.send_body, seq) if self.mac_enabled else None
        pending = bytearray(header)
        for view in views:
            if view.nbytes < _COALESCE:
                if gmac is not None:
                    gmac.authenticate_additional_data(view)
                pending += view
                continue
            if pending:
                self._send_all(memoryview(pending), deadline)
                pending = bytearray()
            step = min(_SEND_PIECE, max(_MAC_STEP, -(-view.nbytes // 2)))
            for start in range(0, view.nbytes, step):
                piece = view[start:start + step]
                if gmac is not None:
                    gmac.authenticate_additional_data(piece)
                self._send_all(piece, deadline)
        if gmac is not None:
            gmac.update(header)
            gmac.finalize()
            pending += gmac.tag
        else:
            pending += _ZERO_TAG
        self._send_all(memoryview(pending), deadline)

    def _write_encrypted(self, header: bytes, views: list[memoryview], nbytes: int, seq: int,
                         deadline: float | None) -> None:
        if nbytes < _COALESCE:
            # Small frame: one AEAD call over the joined body, one send.
            body: Any = views[0] if len(views) == 1 else b"".join(views)
            if not _AEAD_INTO:
                sealed = self._keys.send_gcm.encrypt(_GCM_NONCE.pack(0, seq), body, header)
                self._send_all(memoryview(header + sealed), deadline)
                return
            frame = _thread_buffer(HEADER_SIZE + nbytes + BODY_TAG_SIZE)
            frame[:HEADER_SIZE] = header
            self._keys.send_gcm.encrypt_into(_GCM_NONCE.pack(0, seq), body, header,
                                             frame[HEADER_SIZE:])
            self._send_all(frame, deadline)
            return
        # Big frame: each piece is read from the arrays' memory, encrypted into
        # a reused scratch buffer and sent while it is still in cache.
        gcm = _streaming_gcm(self._keys.send_body, seq, header)
        buffer = _take_scratch()
        try:
            scratch = memoryview(buffer)
            pending = bytearray(header)
            for view in views:
                if view.nbytes < _COALESCE:
                    pending += gcm.update(view)
                    continue
                if pending:
                    self._send_all(memoryview(pending), deadline)
                    pending = bytearray()
                step = min(_SEND_PIECE, max(_MAC_STEP, -(-view.nbytes // 2)))
                for start in range(0, view.nbytes, step):
                    piece = view[start:start + step]
                    out = scratch[:piece.nbytes]
                    gcm.update_into(piece, out)
                    self._send_all(out, deadline)
            pending += gcm.finalize()
            pending += gcm.tag
            self._send_all(memoryview(pending), deadline)
        finally:
            _give_scratch(buffer)

    def _send_all(self, view: memoryview, deadline: float | None = None) -> None:
        # The stall timeout measures lack of progress (no byte taken for
        # ``timeout`` s), not the total time a large frame takes; ``deadline``
        # bounds the total when the caller needs that.
        sent = 0
        total = view.nbytes
        while sent < total:
            try:
                sent += self._sock.send(view[sent:sent + _SEND_CHUNK])
                continue
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as exc:
                if self._closed:
                    raise self._closed_error() from None
                raise PeerLostError(f"lost {self.peer.describe()} while sending: {exc}") from None
            wait = self._timeout
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerLostError(
                        f"{self.peer.describe()} was still being written to when the write's "
                        f"deadline passed ({sent} of {total} bytes of this piece written): it "
                        f"reads too slowly; dropped")
                wait = min(wait, left)
            if not self._write_poll.wait(wait):
                if deadline is not None and time.monotonic() >= deadline:
                    continue  # reported above, with the deadline's message
                raise PeerLostError(
                    f"{self.peer.describe()} took no data for {self.timeout} s "
                    f"({sent} of {total} bytes written); dropped as stalled")

    # -- receiving -------------------------------------------------------------------------

    def recv(self, timeout: float | None = _UNSET, *, place: Placer | None = None) -> Frame:
        """Receive the next frame.

        ``timeout`` bounds the wait for a frame to *start* (default: the
        channel's timeout; None waits until a frame arrives or the channel
        closes); expiry raises :class:`RecvTimeout` and leaves the channel
        usable. Once a frame has started, a stall longer than the channel's
        timeout is a :class:`PeerLostError`. With ``place``, a body the
        placer expects is received straight into its buffer (see
        :class:`Placer`).
        """
        wait = self.timeout if timeout is _UNSET else timeout
        if wait is not None and wait == float("inf"):
            wait = None
        with self._recv_lock:
            if self._closed:
                raise self._closed_error("is")
            header = bytearray(HEADER_SIZE)
            # Under load the next frame is usually there already: read first,
            # poll only when nothing has arrived.
            try:
                got = self._sock.recv_into(header, HEADER_SIZE)
            except (BlockingIOError, InterruptedError):
                got = -1
            except OSError:
                got = -1  # let the read after the poll report what happened
            if got == 0:
                closed_here = self._closed
                self.close()
                if closed_here:
                    raise self._closed_error()
                raise PeerLostError(f"{self.peer.describe()} closed the connection")
            if got < 0:
                got = 0
                if not self._read_poll.wait(wait):
                    raise RecvTimeout(f"no frame from {self.peer.describe()} within {wait} s")
            try:
                return self._recv_frame(header, got, place)
            except BaseException:
                self.close()
                raise

    def _read_into(self, view: memoryview, what: str, feed: Any = None,
                   mac_end: int = 0, got: int = 0) -> None:
        # With ``feed``, bytes [0, mac_end) are passed to it (as a memoryview)
        # as they arrive, in pieces of about _MAC_STEP, while they are still
        # in cache: to the tag, or decrypted in place. ``got``: bytes already
        # in ``view``.
        total = view.nbytes
        fed = 0
        while got < total:
            try:
                k = self._sock.recv_into(view[got:], min(total - got, _RECV_CHUNK))
            except (BlockingIOError, InterruptedError):
                if not self._read_poll.wait(self._timeout):
                    raise PeerLostError(
                        f"{self.peer.describe()} stalled: no bytes for {self.timeout} s after "
                        f"{got} of {total} bytes of a frame {what}; dropped") from None
                continue
            except OSError as exc:
                if self._closed:
                    raise self._closed_error() from None
                raise PeerLostError(f"lost {self.peer.describe()} while receiving: {exc}") from None
            if k == 0:
                if self._closed:
                    raise self._closed_error()
                if what == "header" and got == 0:
                    raise PeerLostError(f"{self.peer.describe()} closed the connection")
                raise PeerLostError(f"{self.peer.describe()} closed the connection after {got} "
                                    f"of {total} bytes of a frame {what}")
            got += k
            if feed is not None and min(got, mac_end) - fed >= _MAC_STEP:
                upto = min(got, mac_end)
                feed(view[fed:upto])
                fed = upto
        if feed is not None and fed < mac_end:
            feed(view[fed:mac_end])

    def _check_header(self, header: bytearray,
                      allow: int = 0) -> tuple[int, int, int, int, int, int]:
        """Authenticate and check a header: ``(kind, flags, tag, sender, seq, body length)``.

        ``allow``: flags accepted on top of the usual ones (the handshake's resume frames).
        """
        head = bytes(header[:_HEADER.size])
        if self.mac_enabled:
            expected = self._keys.recv_mac(head)
            if not hmac.compare_digest(expected, header[_HEADER.size:]):
                raise AuthenticationError(
                    f"frame header from {self.peer.describe()} failed authentication "
                    "(forged, corrupted or reflected); connection dropped")
        magic, kind, flags, reserved, tag, sender, seq, nbytes = _HEADER.unpack(head)
        if magic != FRAME_MAGIC:
            raise WireError(f"frame from {self.peer.describe()} starts with {magic!r}, expected "
                            f"{FRAME_MAGIC!r}; the stream is out of sync")
        if seq != self._recv_seq:
            raise AuthenticationError(
                f"frame from {self.peer.describe()} has sequence number {seq}, expected "
                f"{self._recv_seq} (a replayed or reordered frame); connection dropped")
        if flags & ~(_KNOWN_HEADER_FLAGS | allow) or reserved or (
                flags & FLAG_SEGMENTED and flags & FLAG_SEGMENT) or (
                flags & FLAG_RESUMABLE and not flags & FLAG_SEGMENTED):
            raise WireError(f"frame from {self.peer.describe()} has unknown flags {flags:#x}")
        if nbytes > self.max_frame:
            raise WireError(
                f"{self.peer.describe()} announced a frame body of {nbytes} bytes, above this "
                f"node's max_frame of {self.max_frame}; refused before reading it")
        if nbytes > self.largest_received:
            self.largest_received = nbytes
        return kind, flags, tag, sender, seq, nbytes

    def _recv_frame(self, header: bytearray, got: int, place: Placer | None = None) -> Frame:
        if got < HEADER_SIZE:  # usually the whole header came with the first read
            self._read_into(memoryview(header), "header", got=got)
        kind, flags, tag, sender, seq, nbytes = self._check_header(header)
        if flags & FLAG_SEGMENT:
            raise WireError(f"{self.peer.describe()} sent a segment (tag 0x{tag:08X}) that no "
                            f"lead frame announced; the stream is out of sync")
        if flags & FLAG_SEGMENTED:
            first = 0
            if flags & FLAG_RESUMABLE:
                body, count, first = read_resumable(self, bytes(header), kind, flags, tag, sender,
                                                    seq, nbytes)
            else:
                body, count = read_segmented(self, bytes(header), kind, tag, sender, seq, nbytes)
            flags &= ~(FLAG_SEGMENTED | FLAG_RESUMABLE)
            return Frame(kind=kind, tag=tag, sender=sender, seq=seq,
                         state=decode_state(body, flags=flags), bf16=bool(flags & FLAG_BF16),
                         nbytes=body.nbytes, body=body, flags=flags, segments=count,
                         resumed_from=first)
        # Only now, with the header authenticated and its length bounded, is
        # anything body-sized allocated. Body and tag arrive in one read.
        head_size = 0 if place is None else place.head_size(tag, flags, nbytes)
        if place is not None and 0 < head_size <= nbytes:
            return self._recv_placed(bytes(header), kind, flags, tag, sender, seq, nbytes,
                                     head_size, place)
        whole = _receive_buffer(nbytes + BODY_TAG_SIZE)
        body = whole[:nbytes]
        if self.encrypted:
            self._decrypt_into(whole, bytes(header), seq, tag, nbytes)
        elif not self.mac_enabled:
            self._read_into(whole.data, "body")
        elif nbytes < _MAC_STEP:
            self._read_into(whole.data, "body")
            expected = _body_tag(self._keys.recv_gcm, self._keys.recv_body, seq, bytes(header),
                                 [body.data])
        else:
            gmac = _streaming_gmac(self._keys.recv_body, seq)
            self._read_into(whole.data, "body", gmac.authenticate_additional_data, nbytes)
            gmac.update(bytes(header))
            gmac.finalize()
            expected = gmac.tag
        if self.mac_enabled and not self.encrypted:
            if not hmac.compare_digest(expected, whole[nbytes:].tobytes()):
                raise AuthenticationError(
                    f"frame body from {self.peer.describe()} (tag 0x{tag:08X}, {nbytes} bytes) "
                    "failed authentication (forged or corrupted); connection dropped")
        self._recv_seq = seq + 1
        state = decode_state(body, flags=flags)
        return Frame(kind=kind, tag=tag, sender=sender, seq=seq, state=state,
                     bf16=bool(flags & FLAG_BF16), nbytes=nbytes, body=body, flags=flags)

    def _recv_placed(self, header: bytes, kind: int, flags: int, tag: int, sender: int,
                     seq: int, nbytes: int, head_size: int, place: Placer) -> Frame:
        """Receive a body a :class:`Placer` may take: its head first, then the rest where it says.

        The head is decrypted (or fed to the tag) like any body bytes and
        only compared by the placer; the rest goes to the placer's buffer,
        or, when the placer declines, after the head into a receive buffer
        as usual. The tag is checked before the frame is returned either way.
        """
        context, feed = self._body_reader(header, seq)
        head = np.empty(head_size, dtype=np.uint8)
        self._read_into(head.data, "body", feed, head_size)
        chosen = place.place(head.tobytes())
        body: np.ndarray | None = None
        if chosen is not None and _byte_view(chosen[0]).nbytes == nbytes - head_size:
            target, state = chosen
            rest = _byte_view(target)
        else:
            chosen = None
            body = _receive_buffer(nbytes)
            body[:head_size] = head
            rest = body.data[head_size:]
        self._read_into(rest, "body", feed, rest.nbytes)
        del rest
        self._check_body_tag(context, header, seq, tag, nbytes)
        if chosen is None:
            assert body is not None
            return Frame(kind=kind, tag=tag, sender=sender, seq=seq,
                         state=decode_state(body, flags=flags), bf16=bool(flags & FLAG_BF16),
                         nbytes=nbytes, body=body, flags=flags)
        return Frame(kind=kind, tag=tag, sender=sender, seq=seq, state=dict(state),
                     bf16=bool(flags & FLAG_BF16), nbytes=nbytes, body=None, flags=flags,
                     placed=True)

    def _body_reader(self, header: bytes, seq: int) -> tuple[Any, Any]:
        """The body's streaming context and what to feed it each received piece (or None)."""
        if self.encrypted:
            context = _streaming_gcm(self._keys.recv_body, seq, header, decrypt=True)

            def feed(piece: memoryview) -> None:
                context.update_into(piece, piece)
            return context, feed
        if self.mac_enabled:
            context = _streaming_gmac(self._keys.recv_body, seq)
            return context, context.authenticate_additional_data
        return None, None

    def _check_body_tag(self, context: Any, header: bytes, seq: int, tag: int,
                        nbytes: int) -> None:
        """Read the body's 16-byte tag and check it against ``context``; count the frame."""
        received = bytearray(BODY_TAG_SIZE)
        self._read_into(memoryview(received), "body")
        failed = False
        if self.encrypted:
            try:
                context.finalize_with_tag(bytes(received))
            except InvalidTag:
                failed = True
        elif self.mac_enabled:
            context.update(header)
            context.finalize()
            failed = not hmac.compare_digest(context.tag, bytes(received))
        if failed:
            raise AuthenticationError(
                f"frame body from {self.peer.describe()} (tag 0x{tag:08X}, {nbytes} bytes) "
                "failed authentication (forged or corrupted); connection dropped")
        self._recv_seq = seq + 1

    def _read_body(self, header: bytes, seq: int, tag: int, view: memoryview) -> None:
        """Read one frame's body into ``view`` (all of it) and its tag; decrypt, check."""
        context, feed = self._body_reader(header, seq)
        self._read_into(view, "body", feed, view.nbytes)
        self._check_body_tag(context, header, seq, tag, view.nbytes)

    def _decrypt_into(self, whole: np.ndarray, header: bytes, seq: int, tag: int,
                      nbytes: int) -> None:
        """Read an encrypted body and its tag; open it into ``whole`` and verify."""
        view = whole.data
        try:
            if nbytes < _MAC_STEP:
                nonce = _GCM_NONCE.pack(0, seq)
                if _AEAD_INTO:  # opened from the thread's buffer straight into the frame's
                    sealed = _thread_buffer(nbytes + BODY_TAG_SIZE)
                    self._read_into(sealed, "body")
                    self._keys.recv_gcm.decrypt_into(nonce, sealed, header, view[:nbytes])
                else:
                    self._read_into(view, "body")
                    plain = self._keys.recv_gcm.decrypt(nonce, view, header)
                    whole[:nbytes] = np.frombuffer(plain, dtype=np.uint8)
                return
            gcm = _streaming_gcm(self._keys.recv_body, seq, header, decrypt=True)

            def decrypt(piece: memoryview) -> None:
                gcm.update_into(piece, piece)

            self._read_into(view, "body", decrypt, nbytes)
            gcm.finalize_with_tag(whole[nbytes:].tobytes())
        except InvalidTag:
            raise AuthenticationError(
                f"frame body from {self.peer.describe()} (tag 0x{tag:08X}, {nbytes} bytes) "
                "failed authentication (forged or corrupted); connection dropped") from None
