"""The encrypted, authenticated wire codec: handshake, frames and tensor tables.

Everything that crosses a socket between two meshkit nodes goes through this
package. It knows nothing about rank registries, routing or reductions (that
is the transport's job); it turns a connected stream socket into a
:class:`Channel` that sends and receives authenticated frames carrying a
*state* (``Mapping[str, numpy.ndarray | JSON value]``).

The exact byte layout is in ``docs/wire.md``. In short:

* **Handshake** (:func:`handshake`): both ends send an 80-byte hello (magic,
  protocol version, flags, role, rank, world, max frame, session id, and an
  ephemeral X25519 public key as the 32-byte nonce), derive per-connection,
  per-direction keys with HKDF-SHA256 from the shared secret and the X25519
  shared value, salted with a hash of both hellos, and prove they hold the
  key with a 32-byte confirmation MAC. An end with a node key
  (:class:`NodeKey`) then signs that transcript with Ed25519. A wrong secret
  is an :class:`~meshkit.errors.AuthenticationError` on both ends; a
  protocol version, world size or encryption setting that differs is a
  :class:`~meshkit.errors.WireError` naming both values.
* **Frames**: a 64-byte header (kind, flags, tag, sender, sequence number,
  body length) with its own HMAC-SHA256, checked *before* the body is
  allocated or read; then the body, AES-256-GCM encrypted with the header as
  associated data (under a per-direction key, nonce = the frame's sequence
  number); then the 16-byte GCM tag. With ``encrypt=False`` on both ends the
  body travels in clear and the tag is the GCM tag of the header with the
  body as associated data (AES-GMAC). Either way the tag binds the body to
  its header. Sequence numbers are per direction, so a replayed, reordered
  or reflected frame is an :class:`~meshkit.errors.AuthenticationError`.
* **Body**: a tensor table of named arrays (bool, int8..int64, uint8..uint64,
  float16, bfloat16, float32, float64, little-endian, C order) and JSON
  leaves. Never pickle, never eval. Optionally float32 arrays travel as
  bfloat16 (``send(..., bf16=True)``) and are widened back to float32 on
  receipt; every other value travels exactly.

Public API
----------
``handshake(sock, secret, *, rank, world, encrypt=True, node_key=None, ...) -> Channel``
    Authenticate a connected socket (either end calls the same function).
``Channel``
    ``send(kind, tag, state, *, bf16=False, sender=None) -> int``,
    ``send_encoded(kind, tag, encoded, *, sender=None) -> int`` (encode
    once, scatter to many), ``recv(timeout=...) -> Frame``,
    ``forward(frame, *, sender=None)`` (relay without re-encoding; the body
    tag is recomputed under the outgoing channel's key), ``close()``;
    attributes ``rank``, ``world``, ``peer`` (a
    :class:`Hello`), ``peer_key`` (the node key it proved, or None),
    ``encrypted``, ``timeout``, ``max_frame``, ``closed``. One receiving
    thread and any number of sending threads may use a channel at the same
    time (sends are serialised by a lock; ``close()`` from any thread wakes
    a blocked ``recv``).
``Frame``
    ``kind``, ``tag``, ``sender``, ``seq``, ``state``, ``bf16``, ``nbytes``,
    ``body`` (the raw buffer), ``flags``, ``placed``.
``Placer``
    What ``recv(place=...)`` takes: ``head_size(tag, flags, nbytes)`` and
    ``place(head) -> (target, state) | None``, so a body the receiver
    expects is read (decrypted, authenticated) straight into its buffer.
``Hello``
    What a peer announced in the handshake (authenticated once
    :func:`handshake` returns).
``RecvTimeout``
    :class:`~meshkit.errors.PeerLostError` subclass raised by
    :meth:`Channel.recv` when no frame *started* within the timeout; the
    channel stays usable. Every other error closes the channel.
``encode_state(state, *, bf16=False) -> EncodedState``, ``decode_state(body, *, flags=0) -> dict``
    The body codec on its own (used by the channel; public for tests,
    fuzzing and other transports).
``recycle_large_messages(count)``
    Keep up to ``count`` (0 to 4; default 0) received message bodies above
    64 MiB for reuse once nothing refers to them: a worker, which holds the
    model it was sent until the next has arrived, asks for 2 so its bodies
    stop being fresh memory the kernel zeroes. Process-wide; a coordinator
    (bounded to two models) leaves it off.
``seal_datagram(secret, payload) -> bytes``, ``open_datagram(secret, datagram) -> bytes``
    Authenticate single datagrams (UDP discovery) under a key derived from
    the shared secret.
``read_secret_file(path, what) -> bytes``, ``secret_from_text(value, what) -> bytes``, ``check_private_file(path, what)``
    How each secret source becomes bytes (whitespace stripped at both ends,
    never hex-decoded, at least ``MIN_SECRET`` = 16 bytes, files mode 0600).
``NodeKey``, ``generate_node_key(path)``, ``load_node_key(path)``, ``public_key_text``, ``parse_public_key``, ``fingerprint``
    Ed25519 node identity: the key files ``meshkit keygen`` writes.
``AuthorizedNodes``, ``AuthorizedKey``, ``load_authorized_nodes(path)``
    The coordinator's ``authorized_nodes`` file; ``problem(key, rank)`` says
    why a node may not join, or None.
Constants: ``PROTOCOL_VERSION``, ``DEFAULT_MAX_FRAME``, ``MAX_TENSORS``,
``MAX_NDIM``, ``MAX_NAME_BYTES``, ``RESERVED_TAG_BASE``, ``HELLO_MAGIC``,
``HELLO_SIZE``, ``HEADER_SIZE``, ``MAC_SIZE``, ``BODY_TAG_SIZE``, ``FLAG_BF16``,
``DTYPE_CODES``, ``MIN_SECRET``, ``HELLO_FLAG_PLAINTEXT``, ``HELLO_FLAG_NODE_KEY``;
segments (issue 39): ``FLAG_SEGMENTED``, ``FLAG_SEGMENT``, ``SEGMENT_LEAD``,
``SEGMENT_UNIT``, ``DEFAULT_SEGMENT_BYTES``, ``MAX_SEGMENT_BYTES``,
``DEFAULT_MAX_MESSAGE``, and ``check_segment_bytes(value)`` (what is wrong
with a segment size, or None); resume (issue 39, version 5): ``Transfer``
(a message that resumes where a cut left it: ``Channel.send_resumable``,
offered again with ``handshake(..., offers=[...])``), ``Answer``,
``PartialStore`` (what a receiver keeps of cut transfers, bounded in bytes,
count and time; ``handshake(..., partials=store)``), ``body_digest``,
``FLAG_RESUMABLE``, ``FLAG_RESUME``, ``HELLO_FLAG_RESUME``, ``RESUME_LEAD``,
``RESUME_OFFER``, ``RESUME_ANSWER``, ``RESUME_COUNT``, ``MAX_OFFERS``,
``DEFAULT_PARTIAL_BYTES``, ``DEFAULT_PARTIAL_COUNT``, ``DEFAULT_PARTIAL_TTL``.

A body larger than a link's segment size (the smaller of the two ends'
``segment`` announced in the hello, and of their ``max_frame``) travels as a
lead frame and its segments, each an ordinary authenticated frame; the
receiver reads the segments straight into one buffer of the whole body, so
a message may be larger than ``max_frame`` (up to ``max_message``).

Decoded arrays are **writable numpy views** into one buffer that holds that
frame alone, so they may be folded from or modified in place; they keep the
frame's buffer alive while referenced. A channel recycles a receive buffer
only once nothing (no array, view, frame or memoryview) refers to it any
more, which keeps a steady stream of frames in cache.
Arrays sent as bfloat16 for float32 are widened into fresh float32 arrays.

Where things live
-----------------
One idea per module (none imports a higher one; ``_codec`` and ``_keys``
import no sibling):

* ``_codec``: the sans-io layouts: hello, frame header, tensor-table body
  (:func:`encode_state`, :func:`decode_state`); bounds checked before
  allocation, JSON depth.
* ``_keys``: the shared secret's check, HKDF, the per-connection key schedule.
* ``_secrets``: how each secret source becomes bytes; private-file modes.
* ``_identity``: Ed25519 node keys, their files, ``authorized_nodes``.
* ``_sockets``: socket plumbing (:func:`close_socket`, exact reads under a
  deadline, poll, send-queue room).
* ``_channel``: every byte a frame puts on the socket: :class:`Channel`,
  :class:`Frame`, sequence numbers, header MAC, body encryption and tag,
  timeouts.
* ``_buffers``: the process-wide receive-buffer pool and send scratch
  buffers every channel shares.
* ``_segments``: a message bigger than one segment, cut into a lead frame
  and segments and read back into one buffer (docs/wire.md §2.4).
* ``_partials``: what a receiver keeps of a cut transfer, and for how long
  (:class:`PartialStore`).
* ``_resume``: a cut transfer resumes: :class:`Transfer`, the resumable
  lead, the offer and answer after the handshake (docs/wire.md §2.5).
* ``_handshake``: the hello exchange, :func:`handshake`.
* ``_datagrams``: :func:`seal_datagram` and :func:`open_datagram`.
"""

from __future__ import annotations

from meshkit.wire._buffers import recycle_large_messages
from meshkit.wire._channel import (
    DEFAULT_MAX_FRAME,
    DEFAULT_MAX_MESSAGE,
    Channel,
    Frame,
    Placer,
    RecvTimeout,
)
from meshkit.wire._codec import (
    _HELLO,  # noqa: F401 - tests forge hellos with wire._HELLO
    BODY_TAG_SIZE,
    DEFAULT_SEGMENT_BYTES,
    DTYPE_CODES,
    FLAG_BF16,
    FLAG_RESUMABLE,
    FLAG_RESUME,
    FLAG_SEGMENT,
    FLAG_SEGMENTED,
    HEADER_SIZE,
    HELLO_FLAG_NODE_KEY,
    HELLO_FLAG_PLAINTEXT,
    HELLO_FLAG_RESUME,
    HELLO_MAGIC,
    HELLO_SIZE,
    MAC_SIZE,
    MAX_NAME_BYTES,
    MAX_NDIM,
    MAX_SEGMENT_BYTES,
    MAX_TENSORS,
    PROTOCOL_VERSION,
    RESERVED_TAG_BASE,
    RESUME_ANSWER,
    RESUME_COUNT,
    RESUME_LEAD,
    RESUME_OFFER,
    SEGMENT_LEAD,
    SEGMENT_UNIT,
    EncodedState,
    Hello,
    check_segment_bytes,
    decode_state,
    encode_state,
)
from meshkit.wire._datagrams import open_datagram, seal_datagram
from meshkit.wire._handshake import handshake
from meshkit.wire._identity import (
    AuthorizedKey,
    AuthorizedNodes,
    NodeKey,
    fingerprint,
    generate_node_key,
    load_authorized_nodes,
    load_node_key,
    parse_public_key,
    public_key_text,
)
from meshkit.wire._keys import MIN_SECRET
from meshkit.wire._partials import (
    DEFAULT_PARTIAL_BYTES,
    DEFAULT_PARTIAL_COUNT,
    DEFAULT_PARTIAL_TTL,
    RESUME_STATUS,
    PartialStore,
)
from meshkit.wire._resume import MAX_OFFERS, Answer, Transfer, body_digest
from meshkit.wire._secrets import check_private_file, read_secret_file, secret_from_text
from meshkit.wire._sockets import close_socket

__all__ = [
    "close_socket",
    "PROTOCOL_VERSION",
    "DEFAULT_MAX_FRAME",
    "MAX_TENSORS",
    "MAX_NDIM",
    "MAX_NAME_BYTES",
    "RESERVED_TAG_BASE",
    "HELLO_MAGIC",
    "HELLO_SIZE",
    "HEADER_SIZE",
    "MAC_SIZE",
    "BODY_TAG_SIZE",
    "FLAG_BF16",
    "FLAG_SEGMENTED",
    "FLAG_SEGMENT",
    "SEGMENT_LEAD",
    "SEGMENT_UNIT",
    "DEFAULT_SEGMENT_BYTES",
    "MAX_SEGMENT_BYTES",
    "DEFAULT_MAX_MESSAGE",
    "check_segment_bytes",
    "FLAG_RESUMABLE",
    "FLAG_RESUME",
    "HELLO_FLAG_RESUME",
    "RESUME_LEAD",
    "RESUME_OFFER",
    "RESUME_ANSWER",
    "RESUME_COUNT",
    "MAX_OFFERS",
    "Transfer",
    "Answer",
    "PartialStore",
    "DEFAULT_PARTIAL_BYTES",
    "DEFAULT_PARTIAL_COUNT",
    "DEFAULT_PARTIAL_TTL",
    "RESUME_STATUS",
    "body_digest",
    "DTYPE_CODES",
    "Hello",
    "Frame",
    "Placer",
    "Channel",
    "RecvTimeout",
    "EncodedState",
    "handshake",
    "encode_state",
    "decode_state",
    "recycle_large_messages",
    "seal_datagram",
    "open_datagram",
    "MIN_SECRET",
    "HELLO_FLAG_PLAINTEXT",
    "HELLO_FLAG_NODE_KEY",
    "read_secret_file",
    "secret_from_text",
    "check_private_file",
    "NodeKey",
    "generate_node_key",
    "load_node_key",
    "public_key_text",
    "parse_public_key",
    "fingerprint",
    "AuthorizedKey",
    "AuthorizedNodes",
    "load_authorized_nodes",
]
