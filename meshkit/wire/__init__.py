"""The authenticated wire codec: handshake, frames and tensor tables.

Everything that crosses a socket between two meshkit nodes goes through this
module. It knows nothing about ranks registries, routing or reductions (that
is the transport's job); it turns a connected stream socket into a
:class:`Channel` that sends and receives authenticated frames carrying a
*state* (``Mapping[str, numpy.ndarray | JSON value]``).

The exact byte layout is in ``docs/wire.md``. In short:

* **Handshake** (:func:`handshake`): both ends send an 80-byte hello (magic,
  protocol version, flags, role, rank, world, max frame, session id, 32-byte
  random nonce), derive per-connection, per-direction keys with HKDF-SHA256
  from the shared secret, salted with a hash of both hellos, and prove they
  hold the key with a 32-byte confirmation MAC. A wrong secret is an
  :class:`~meshkit.errors.AuthenticationError` on both ends; a protocol
  version or world size that differs is a :class:`~meshkit.errors.WireError`
  naming both values.
* **Frames**: a 64-byte header (kind, flags, tag, sender, sequence number,
  body length) with its own HMAC-SHA256, checked *before* the body is
  allocated or read; then the body; then a 16-byte AES-256-GMAC body tag
  (the GCM tag of the header as plaintext with the body as associated data,
  under a per-direction key, nonce = the frame's sequence number), which
  binds the body to its header. Sequence numbers are per direction, so a
  replayed, reordered or reflected frame is an
  :class:`~meshkit.errors.AuthenticationError`.
* **Body**: a tensor table of named arrays (bool, int8..int64, uint8..uint64,
  float16, bfloat16, float32, float64, little-endian, C order) and JSON
  leaves. Never pickle, never eval. Optionally float32 arrays travel as
  bfloat16 (``send(..., bf16=True)``) and are widened back to float32 on
  receipt; every other value travels exactly.

Public API
----------
``handshake(sock, secret, *, rank, world, ...) -> Channel``
    Authenticate a connected socket (either end calls the same function).
``Channel``
    ``send(kind, tag, state, *, bf16=False, sender=None) -> int``,
    ``send_encoded(kind, tag, encoded, *, sender=None) -> int`` (encode
    once, scatter to many), ``recv(timeout=...) -> Frame``,
    ``forward(frame, *, sender=None)`` (relay without re-encoding; the body
    tag is recomputed under the outgoing channel's key), ``close()``;
    attributes ``rank``, ``world``, ``peer`` (a
    :class:`Hello`), ``timeout``, ``max_frame``, ``closed``. One receiving
    thread and any number of sending threads may use a channel at the same
    time (sends are serialised by a lock; ``close()`` from any thread wakes
    a blocked ``recv``).
``Frame``
    ``kind``, ``tag``, ``sender``, ``seq``, ``state``, ``bf16``, ``nbytes``,
    ``body`` (the raw buffer), ``flags``.
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
``seal_datagram(secret, payload) -> bytes``, ``open_datagram(secret, datagram) -> bytes``
    Authenticate single datagrams (UDP discovery) under a key derived from
    the shared secret.
Constants: ``PROTOCOL_VERSION``, ``DEFAULT_MAX_FRAME``, ``MAX_TENSORS``,
``MAX_NDIM``, ``MAX_NAME_BYTES``, ``RESERVED_TAG_BASE``, ``HELLO_SIZE``,
``HEADER_SIZE``, ``MAC_SIZE``, ``BODY_TAG_SIZE``, ``FLAG_BF16``, ``DTYPE_CODES``.

Decoded arrays are **writable numpy views** into one buffer that holds that
frame alone, so they may be folded from or modified in place; they keep the
frame's buffer alive while referenced. A channel recycles a receive buffer
only once nothing (no array, view, frame or memoryview) refers to it any
more, which keeps a steady stream of frames in cache.
Arrays sent as bfloat16 for float32 are widened into fresh float32 arrays.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import select
import socket
import struct
import sys
import threading
import time
from collections import abc
from typing import Any, Mapping

import attrs
import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from meshkit.errors import (
    AuthenticationError,
    ConfigError,
    PeerLostError,
    WireError,
)
from meshkit.state import MAX_JSON_DEPTH, json_depth

try:  # how many bytes a socket's send queue holds (Linux: SIOCOUTQ == TIOCOUTQ)
    import fcntl
    import termios

    _OUTQ_REQUEST: int | None = termios.TIOCOUTQ
except (ImportError, AttributeError):  # pragma: no cover - not on Linux
    _OUTQ_REQUEST = None

__all__ = [
    "close_socket",
    "PROTOCOL_VERSION",
    "DEFAULT_MAX_FRAME",
    "MAX_TENSORS",
    "MAX_NDIM",
    "MAX_NAME_BYTES",
    "RESERVED_TAG_BASE",
    "HELLO_SIZE",
    "HEADER_SIZE",
    "MAC_SIZE",
    "BODY_TAG_SIZE",
    "FLAG_BF16",
    "DTYPE_CODES",
    "Hello",
    "Frame",
    "Channel",
    "RecvTimeout",
    "EncodedState",
    "handshake",
    "encode_state",
    "decode_state",
    "seal_datagram",
    "open_datagram",
]

log = logging.getLogger(__name__)

# Version 2: the body tag is AES-256-GMAC (16 bytes) instead of
# HMAC-SHA256 over the body's SHA-256 (32 bytes).
PROTOCOL_VERSION = 2
#: Largest frame body a channel accepts unless told otherwise (1 GiB).
DEFAULT_MAX_FRAME = 1 << 30
MAX_TENSORS = 65_536
MAX_NDIM = 32
MAX_NAME_BYTES = 1024
#: Tags at or above this value belong to the kernel (handshake, reduce, caps).
RESERVED_TAG_BASE = 0xFFFF0000

HELLO_MAGIC = b"MESHKIT\x00"
FRAME_MAGIC = b"MKF\x01"
MAC_SIZE = 32
#: Size of the AES-GMAC body tag that follows every frame body.
BODY_TAG_SIZE = 16
NONCE_SIZE = 32
SESSION_SIZE = 16

# Hello: magic 8s | version u16 | flags u16 | role u16 | reserved u16 | rank u32 |
# world u32 | max_frame u64 | session 16s | nonce 32s   -> 80 bytes.
_HELLO = struct.Struct("<8sHHHHIIQ16s32s")
HELLO_SIZE = _HELLO.size
# The first 10 bytes (magic + version) keep this layout in every version, so
# two versions can always tell each other apart before anything else.
_HELLO_PREFIX = 10
HELLO_FLAG_NO_MAC = 0x0001

# Frame header: magic 4s | kind u8 | flags u8 | reserved u16 | tag u32 |
# sender u32 | seq u64 | body_len u64 | header MAC 32s  -> 64 bytes.
_HEADER = struct.Struct("<4sBBHIIQQ")
HEADER_SIZE = _HEADER.size + MAC_SIZE
FLAG_BF16 = 0x01
_KNOWN_FRAME_FLAGS = FLAG_BF16

# Body: count u32 | reserved u32, then per entry: kind u8 | dtype u8 | ndim u8 |
# entry flags u8 | name_len u32 | data_len u64, ndim x u64 dims, name bytes.
_BODY_HEAD = struct.Struct("<II")
_ENTRY = struct.Struct("<BBBBIQ")
_DIM = struct.Struct("<Q")
#: ``_DIMS[n]`` packs or unpacks n dimensions at once.
_DIMS = [struct.Struct(f"<{n}Q") for n in range(MAX_NDIM + 1)]
# One encoder for every JSON leaf (json.dumps with options builds one per call).
_JSON_ENCODER = json.JSONEncoder(allow_nan=True, separators=(",", ":"))
ENTRY_ARRAY = 1
ENTRY_JSON = 2
ENTRY_FLAG_WIDEN_F32 = 0x01
DATA_ALIGN = 64

# The labels keep their "meshkit/1" spelling: the hello's version field is
# what tells protocol versions apart, and the body key has its own label.
_LABEL = b"meshkit/1 "
_ZERO_MAC = bytes(MAC_SIZE)
_ZERO_TAG = bytes(BODY_TAG_SIZE)
# 96-bit GCM nonce: 4 zero bytes then the frame's u64 sequence number. The key
# is per connection and per direction and the sequence number never repeats
# in a direction, so a (key, nonce) pair is never reused.
_GCM_NONCE = struct.Struct("<IQ")
# AESGCM's one-shot call takes at most 2**31 - 1 bytes of associated data;
# bigger bodies (max_frame can be raised past 2 GiB) are fed in pieces.
_AAD_PIECE = 1 << 30

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
_SEND_PIECE = 1 << 20
# Receive buffers between these sizes are recycled once nothing refers to them
# (see Channel._receive_buffer); at most _POOL_SIZE per channel are kept, so
# an idle channel holds at most 16 MiB (one buffer per frame a steady stream
# keeps in flight, in practice). Above 4 MiB the transfer dominates and
# numpy backs the allocation with huge pages anyway.
_POOL_MIN = 64 * 1024
_POOL_MAX = 4 << 20
_POOL_SIZE = 4
_RECV_CHUNK = 4 << 20
_SEND_CHUNK = 4 << 20


def _dtype_table() -> dict[int, np.dtype]:
    import ml_dtypes

    names = [
        (1, "bool"), (2, "<i1"), (3, "<u1"), (4, "<i2"), (5, "<u2"), (6, "<i4"), (7, "<u4"),
        (8, "<i8"), (9, "<u8"), (10, "<f2"), (12, "<f4"), (13, "<f8"),
    ]
    table = {code: np.dtype(name) for code, name in names}
    table[11] = np.dtype(ml_dtypes.bfloat16)
    return table


#: Wire dtype code -> numpy dtype (little-endian).
DTYPE_CODES: dict[int, np.dtype] = _dtype_table()
_CODE_OF = {dt: code for code, dt in DTYPE_CODES.items()}
_BF16 = DTYPE_CODES[11]
_F32 = DTYPE_CODES[12]


def _little_endian(dtype: np.dtype) -> np.dtype:
    try:
        return dtype.newbyteorder("<")
    except (TypeError, ValueError):  # extension dtypes (bfloat16) have no byte order to set
        return dtype


def _align(n: int) -> int:
    return (n + DATA_ALIGN - 1) // DATA_ALIGN * DATA_ALIGN


# ----------------------------------------------------------------------------- keys


def _hkdf_extract(salt: bytes, ikm: bytes) -> bytes:
    return hmac.digest(salt, ikm, "sha256")


def _hkdf_expand(prk: bytes, info: bytes) -> bytes:
    # One output block (32 bytes) is all we ever need: T(1) = HMAC(PRK, info | 0x01).
    return hmac.digest(prk, info + b"\x01", "sha256")


def _check_secret(secret: bytes | None) -> bytes:
    if isinstance(secret, str):
        raise ConfigError("the shared secret must be bytes, got a str; pass secret.encode() "
                          "(or read the secret file in binary mode)")
    if secret is None or not isinstance(secret, (bytes, bytearray)) or len(secret) == 0:
        raise ConfigError(
            "no shared secret: every meshkit connection is authenticated with one; "
            "set `secret_file` in [mesh] or MESHKIT_SECRET (all nodes must use the same one)")
    return bytes(secret)


@attrs.frozen(repr=False)
class _Keys:
    send_header: bytes
    #: AES-256 keys of the body tags; the AESGCM objects keep their cipher
    #: contexts, so a small frame's tag costs well under a microsecond.
    send_body: bytes
    recv_header: bytes
    recv_body: bytes
    confirm_mine: bytes
    confirm_theirs: bytes
    send_gcm: AESGCM = attrs.field(init=False)
    recv_gcm: AESGCM = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "send_gcm", AESGCM(self.send_body))
        object.__setattr__(self, "recv_gcm", AESGCM(self.recv_body))


def _streaming_gmac(key: bytes, seq: int) -> Any:
    """A GCM encryptor to feed the body to (``authenticate_additional_data``),
    then the header (``update``); ``finalize()`` then ``.tag`` is the body tag."""
    return Cipher(algorithms.AES(key), modes.GCM(_GCM_NONCE.pack(0, seq))).encryptor()


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


def _derive_keys(secret: bytes, mine: bytes, theirs: bytes) -> _Keys:
    # Both ends hash the two hellos in the same (sorted) order, so the
    # transcript and the keys agree without a dialer/listener role; each
    # direction's keys are bound to the *sender's* nonce, so a frame echoed
    # back to its sender never verifies.
    lo, hi = sorted((mine, theirs))
    transcript = hashlib.sha256(_LABEL + b"transcript" + lo + hi).digest()
    prk = _hkdf_extract(transcript, secret)
    nonce_mine = mine[-NONCE_SIZE:]
    nonce_theirs = theirs[-NONCE_SIZE:]

    def key(label: bytes, nonce: bytes) -> bytes:
        return _hkdf_expand(prk, _LABEL + label + b" " + nonce)

    return _Keys(
        send_header=key(b"header", nonce_mine),
        send_body=key(b"body-gmac", nonce_mine),
        recv_header=key(b"header", nonce_theirs),
        recv_body=key(b"body-gmac", nonce_theirs),
        confirm_mine=hmac.digest(key(b"confirm", nonce_mine), transcript, "sha256"),
        confirm_theirs=hmac.digest(key(b"confirm", nonce_theirs), transcript, "sha256"),
    )


# ----------------------------------------------------------------------------- body codec


@attrs.define(eq=False)
class EncodedState:
    """A state laid out for the wire: ``buffers`` concatenated are the body.

    Encode once and send to many peers with :meth:`Channel.send_encoded`
    (each channel computes its own body tag, which costs far less than the
    encoding it saves).
    """

    buffers: tuple[Any, ...]
    nbytes: int
    flags: int


def _byte_view(buf: Any) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _entry_error(name: str, what: str) -> WireError:
    return WireError(f"cannot put state key {name!r} on the wire: {what}")


def _json_problem(value: Any) -> str | None:
    """What JSON would silently change in ``value``, or None.

    Runs after a successful encode (so ``value`` is finite and acyclic): JSON
    turns int, float, bool and None keys into strings, so the receiver would
    see other keys than were sent (and ``{1: a, "1": b}`` would lose an
    entry), and a tuple into a list, so the receiver would get another type.
    The state model (``meshkit.state.validate_state``) refuses both, and so
    does every transport.
    """
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, tuple):
            return ("a tuple is not a JSON value: JSON would turn it into a list "
                    "(send list(...) yourself)")
        if isinstance(item, dict):
            for key, child in item.items():
                if not isinstance(key, str):
                    return (f"JSON object keys must be strings, found {key!r} "
                            f"({type(key).__name__}); JSON would turn it into a string "
                            f"(convert it yourself)")
                if isinstance(child, (dict, list, tuple)):
                    stack.append(child)
        elif isinstance(item, list):
            stack.extend(child for child in item if isinstance(child, (dict, list, tuple)))
    return None


def encode_state(state: Mapping[str, Any], *, bf16: bool = False) -> EncodedState:
    """Lay ``state`` out as a frame body without copying array data.

    Arrays must have one of the dtypes in :data:`DTYPE_CODES`; everything
    else must be a JSON value (number, str, bool, None, list, dict). With
    ``bf16``, float32 arrays are narrowed to bfloat16 (round to nearest even)
    and marked to be widened back to float32 by the receiver.
    """
    # typing.Mapping's isinstance check costs microseconds; a plain dict none.
    if type(state) is not dict and not isinstance(state, abc.Mapping):
        raise WireError(f"a state must be a mapping of names to arrays or JSON values, "
                        f"got {type(state).__name__}")
    if len(state) > MAX_TENSORS:
        raise WireError(f"a state may carry at most {MAX_TENSORS} entries, got {len(state)}")
    table = bytearray(_BODY_HEAD.pack(len(state), 0))
    datas: list[tuple[Any, int]] = []
    for name, value in state.items():
        if not isinstance(name, str) or not name:
            raise WireError(f"state keys must be non-empty str, got {name!r} "
                            f"({type(name).__name__})")
        raw_name = name.encode("utf-8")
        if len(raw_name) > MAX_NAME_BYTES:
            raise _entry_error(name[:64] + "...", f"its name is {len(raw_name)} bytes of UTF-8, "
                               f"the limit is {MAX_NAME_BYTES}")
        if isinstance(value, np.ndarray):
            dims = value.shape
            if len(dims) > MAX_NDIM:
                raise _entry_error(name, f"{len(dims)} dimensions, the limit is {MAX_NDIM}")
            eflags = 0
            array = value
            if bf16 and value.dtype.kind == "f" and value.dtype.itemsize == 4:
                array = value.astype(_BF16)
                eflags = ENTRY_FLAG_WIDEN_F32
            code = _CODE_OF.get(array.dtype)
            if code is None:
                little = _little_endian(array.dtype)
                if little != array.dtype:
                    # The wire is little-endian whatever the host.
                    array = array.astype(little)
                code = _CODE_OF.get(array.dtype)
                if code is None:
                    raise _entry_error(name, f"dtype {value.dtype} is not a wire dtype; "
                                       "supported: "
                                       + ", ".join(str(d) for d in DTYPE_CODES.values()))
            if not array.flags.c_contiguous:
                array = np.ascontiguousarray(array)
            data = array.reshape(-1).view(np.uint8)
            table += _ENTRY.pack(ENTRY_ARRAY, code, len(dims), eflags, len(raw_name), data.nbytes)
            table += _DIMS[len(dims)].pack(*dims)
            table += raw_name
            datas.append((data, data.nbytes))
        else:
            if isinstance(value, np.generic):
                raise _entry_error(name, f"it is a numpy {value.dtype} scalar; send "
                                   f"numpy.asarray(value) for an array or value.item() for JSON")
            try:
                text = _JSON_ENCODER.encode(value).encode("utf-8")
                if isinstance(value, (dict, list, tuple)):
                    problem = _json_problem(value)
                    if problem:
                        raise _entry_error(name, problem)
            except (TypeError, ValueError, RecursionError) as exc:
                raise _entry_error(name, f"a {type(value).__name__} is neither a numpy array nor "
                                   f"a JSON value ({exc})") from None
            table += _ENTRY.pack(ENTRY_JSON, 0, 0, 0, len(raw_name), len(text))
            table += raw_name
            datas.append((text, len(text)))
    buffers: list[Any] = []
    offset = _align(len(table)) if datas else len(table)
    table += bytes(offset - len(table))
    buffers.append(table)
    for i, (data, n) in enumerate(datas):
        buffers.append(data)
        offset += n
        if i + 1 < len(datas):
            pad = _align(offset) - offset
            if pad:
                buffers.append(bytes(pad))
                offset += pad
    return EncodedState(buffers=tuple(buffers), nbytes=offset,
                        flags=FLAG_BF16 if bf16 else 0)


def decode_state(body: Any, *, flags: int = 0) -> dict[str, Any]:
    """Decode a frame body into a state; arrays are views into ``body``.

    ``body`` is any writable-or-not buffer (a numpy uint8 array gives
    writable views). Every count, length and shape is checked against the
    body's size before use; any inconsistency is a :class:`WireError`.
    """
    buf = body if isinstance(body, np.ndarray) else np.frombuffer(body, dtype=np.uint8)
    if buf.dtype != np.uint8 or buf.ndim != 1:
        buf = buf.reshape(-1).view(np.uint8)
    size = buf.nbytes
    mv = memoryview(buf)
    if size < _BODY_HEAD.size:
        raise WireError(f"frame body of {size} bytes is shorter than its {_BODY_HEAD.size}-byte "
                        "tensor-table header")
    count, reserved = _BODY_HEAD.unpack_from(mv, 0)
    if reserved:
        raise WireError(f"frame body has {reserved:#x} in its reserved field, expected 0 "
                        "(a newer body format?)")
    if count > MAX_TENSORS:
        raise WireError(f"frame claims {count} entries; the limit is {MAX_TENSORS}")
    pos = _BODY_HEAD.size
    entries: list[tuple[str, int, int, tuple[int, ...], int, int]] = []
    for index in range(count):
        if pos + _ENTRY.size > size:
            raise WireError(f"frame body truncated in the table at entry {index} of {count}")
        kind, code, ndim, eflags, name_len, data_len = _ENTRY.unpack_from(mv, pos)
        pos += _ENTRY.size
        if kind not in (ENTRY_ARRAY, ENTRY_JSON):
            raise WireError(f"entry {index}: unknown entry kind {kind} "
                            "(expected 1 array or 2 JSON)")
        if ndim > MAX_NDIM:
            raise WireError(f"entry {index}: {ndim} dimensions, the limit is {MAX_NDIM}")
        if name_len > MAX_NAME_BYTES:
            raise WireError(f"entry {index}: name of {name_len} bytes, "
                            f"the limit is {MAX_NAME_BYTES}")
        if data_len > size:
            raise WireError(f"entry {index}: claims {data_len} bytes of data in a {size}-byte body")
        if pos + ndim * _DIM.size + name_len > size:
            raise WireError(f"frame body truncated in the table at entry {index} of {count}")
        dims = _DIMS[ndim].unpack_from(mv, pos)
        pos += ndim * _DIM.size
        try:
            name = bytes(mv[pos:pos + name_len]).decode("utf-8")
        except UnicodeDecodeError:
            raise WireError(f"entry {index}: name is not valid UTF-8") from None
        pos += name_len
        if kind == ENTRY_ARRAY:
            dtype = DTYPE_CODES.get(code)
            if dtype is None:
                raise WireError(f"entry {name!r}: unknown dtype code {code}")
            if eflags & ~ENTRY_FLAG_WIDEN_F32 or (eflags and code != 11):
                raise WireError(f"entry {name!r}: unknown entry flags {eflags:#x} "
                                f"for dtype {dtype}")
            elements = 1
            for d in dims:
                elements *= d  # Python ints: no overflow however large the claim
            if elements * dtype.itemsize != data_len:
                raise WireError(f"entry {name!r}: shape {dims} of {dtype} needs "
                                f"{elements * dtype.itemsize} bytes, the table says {data_len}")
        elif code or ndim or eflags:
            raise WireError(f"entry {name!r}: a JSON entry must have dtype, ndim and flags 0")
        entries.append((name, kind, code, dims, eflags, data_len))
    offset = _align(pos) if entries else pos
    state: dict[str, Any] = {}
    for i, (name, kind, code, dims, eflags, data_len) in enumerate(entries):
        end = offset + data_len
        if end > size:
            raise WireError(f"entry {name!r}: data runs to byte {end} of a {size}-byte body")
        if name in state:
            raise WireError(f"entry {name!r} appears twice in one frame")
        if kind == ENTRY_ARRAY:
            dtype = DTYPE_CODES[code]
            try:
                array = buf[offset:end].view(dtype).reshape(dims)
            except ValueError as exc:  # e.g. a zero-sized shape with an absurd dimension
                raise WireError(f"entry {name!r}: shape {dims} is not a valid array shape "
                                f"({exc})") from None
            if code == 1 and data_len and int(buf[offset:end].max()) > 1:
                raise WireError(f"entry {name!r}: a bool array holds bytes other than 0 and 1")
            if eflags & ENTRY_FLAG_WIDEN_F32:
                array = array.astype(_F32)
            state[name] = array
        else:
            try:
                value = json.loads(bytes(mv[offset:end]).decode("utf-8"))
            except (ValueError, RecursionError) as exc:
                raise WireError(f"entry {name!r}: invalid JSON ({type(exc).__name__})") from None
            # Bounded like every other count: whatever walks it later (a fold,
            # validation) recurses, and must not be driven past the stack.
            if json_depth(value) > MAX_JSON_DEPTH:
                raise WireError(f"entry {name!r}: JSON nested more than {MAX_JSON_DEPTH} "
                                f"levels deep")
            state[name] = value
        offset = end if i + 1 == len(entries) else _align(end)
    if offset != size:
        raise WireError(f"frame body is {size} bytes but its table accounts for {offset}")
    if flags & ~_KNOWN_FRAME_FLAGS:
        raise WireError(f"unknown frame flags {flags:#x}")
    return state


# ----------------------------------------------------------------------------- handshake


@attrs.frozen
class Hello:
    """What one end announced in the handshake (authenticated after it)."""

    version: int
    flags: int
    role: int
    rank: int
    world: int
    max_frame: int
    session: bytes
    nonce: bytes
    address: str = ""

    def describe(self) -> str:
        where = f" at {self.address}" if self.address else ""
        return f"peer{where} (claims rank {self.rank} of world {self.world})"


def _peer_address(sock: socket.socket) -> str:
    try:
        name = sock.getpeername()
    except OSError:
        return ""
    if isinstance(name, tuple) and len(name) >= 2:
        return f"{name[0]}:{name[1]}"
    return str(name) if name else ""


def _read_exact(sock: socket.socket, n: int, what: str, where: str, deadline: float) -> bytes:
    data = bytearray(n)
    view = memoryview(data)
    got = 0
    while got < n:
        # A deadline for the whole handshake, not per read: a peer dribbling
        # one byte at a time cannot hold the slot open for long.
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise socket.timeout
            sock.settimeout(remaining)
            k = sock.recv_into(view[got:], n - got)
        except socket.timeout:
            raise PeerLostError(f"{where} sent {got} of {n} bytes of its {what} and then "
                                "nothing until the handshake timeout; dropped") from None
        except OSError as exc:
            raise PeerLostError(f"{where} failed during the {what}: {exc}") from None
        if k == 0:
            raise PeerLostError(f"{where} closed the connection after {got} of {n} bytes of "
                                f"its {what}")
        got += k
    return bytes(data)


def handshake(
    sock: socket.socket,
    secret: bytes | None,
    *,
    rank: int,
    world: int,
    role: int = 0,
    session: bytes = b"",
    timeout: float = 30.0,
    handshake_timeout: float | None = None,
    max_frame: int = DEFAULT_MAX_FRAME,
    benchmark_only_disable_mac: bool = False,
) -> Channel:
    """Authenticate a connected stream socket and return a :class:`Channel`.

    Both ends call this (there is no dialer/listener asymmetry). ``rank`` and
    ``world`` are what this end announces; the peer's claims are in
    ``channel.peer`` once this returns (the transport checks rank ranges and
    duplicates). ``role`` is an opaque 16-bit value for the transport.
    ``session`` (at most 16 bytes) identifies a job: two ends with different
    non-empty sessions refuse each other. ``timeout`` is the channel's
    read/write stall timeout; ``handshake_timeout`` (default ``timeout``)
    bounds the whole handshake.

    ``benchmark_only_disable_mac`` turns frame MACs off (the handshake is
    still authenticated) so benchmarks can measure the MAC's cost. Both ends
    must set it; it is never read from configuration and a peer cannot ask
    for it.

    Raises :class:`AuthenticationError` (wrong secret, reflection),
    :class:`WireError` (not meshkit, version/world/session mismatch) or
    :class:`PeerLostError` (peer closed or stalled), and closes ``sock``.
    """
    try:
        secret = _check_secret(secret)
        if not 0 <= rank < world:
            raise ConfigError(f"rank {rank} is out of range for a world of {world}")
        if len(session) > SESSION_SIZE:
            raise ConfigError(f"session id must be at most {SESSION_SIZE} bytes, "
                              f"got {len(session)}")
        if not 0 < max_frame < 1 << 63:
            raise ConfigError(f"max_frame must be a positive byte count, got {max_frame}")
    except ConfigError:
        close_socket(sock)  # as on every other error: the peer must not wait on it
        raise
    deadline_budget = timeout if handshake_timeout is None else handshake_timeout
    deadline = time.monotonic() + deadline_budget
    address = _peer_address(sock)
    where = f"peer at {address}" if address else "peer"
    flags = HELLO_FLAG_NO_MAC if benchmark_only_disable_mac else 0
    nonce = os.urandom(NONCE_SIZE)
    mine = _HELLO.pack(HELLO_MAGIC, PROTOCOL_VERSION, flags, role, 0, rank, world, max_frame,
                       session.ljust(SESSION_SIZE, b"\x00"), nonce)
    try:
        _configure(sock)
        sock.settimeout(deadline_budget)
        try:
            sock.sendall(mine)
        except socket.timeout:
            raise PeerLostError(f"{where} did not take our handshake within "
                                f"{deadline_budget} s; dropped") from None
        except OSError as exc:
            raise PeerLostError(f"{where} failed during the handshake: {exc}") from None
        prefix = _read_exact(sock, _HELLO_PREFIX, "handshake", where, deadline)
        magic, version = struct.unpack("<8sH", prefix)
        if magic != HELLO_MAGIC:
            raise WireError(f"{where} is not a meshkit node: its first bytes are {prefix[:8]!r}, "
                            f"expected {HELLO_MAGIC!r}; check the address and port")
        if version != PROTOCOL_VERSION:
            raise WireError(f"{where} speaks meshkit wire protocol version {version}, this node "
                            f"speaks version {PROTOCOL_VERSION}; run the same meshkit release "
                            "on every node")
        theirs = prefix + _read_exact(sock, HELLO_SIZE - _HELLO_PREFIX, "handshake", where,
                                      deadline)
        fields = _HELLO.unpack(theirs)
        peer = Hello(version=fields[1], flags=fields[2], role=fields[3], rank=fields[5],
                     world=fields[6], max_frame=fields[7], session=fields[8].rstrip(b"\x00"),
                     nonce=fields[9], address=address)
        if peer.nonce == nonce:
            raise AuthenticationError(f"{where} echoed our own handshake back (a reflection); "
                                      "refused")
        keys = _derive_keys(secret, mine, theirs)
        try:
            sock.sendall(keys.confirm_mine)
        except (socket.timeout, OSError) as exc:
            raise PeerLostError(f"{peer.describe()} failed during the handshake: {exc}") from None
        confirm = _read_exact(sock, MAC_SIZE, "key confirmation", peer.describe(), deadline)
        if not hmac.compare_digest(confirm, keys.confirm_theirs):
            raise AuthenticationError(
                f"{peer.describe()} failed authentication: its key confirmation does not match "
                "ours (wrong secret? every node must use the same shared secret)")
        # From here on the peer's hello is authenticated, so its claims are
        # worth reporting as facts.
        if peer.world != world:
            raise WireError(f"{peer.describe()} is in a world of {peer.world}, this node "
                            f"(rank {rank}) is in a world of {world}; every node must be "
                            "started with the same world size")
        if not 0 <= peer.rank < peer.world:
            raise WireError(f"{peer.describe()}: rank {peer.rank} is out of range 0..{world - 1}")
        if peer.session and session and peer.session != session.rstrip(b"\x00"):
            raise WireError(f"{peer.describe()} belongs to job {peer.session.hex()}, this node to "
                            f"job {session.hex()}; refused")
        if (peer.flags & HELLO_FLAG_NO_MAC) != flags:
            raise WireError(f"{peer.describe()} has frame MACs "
                            f"{'off' if peer.flags & HELLO_FLAG_NO_MAC else 'on'}, this node has "
                            f"them {'off' if flags else 'on'}; MACs may only be disabled on both "
                            "ends, for benchmarks")
        if peer.flags & ~HELLO_FLAG_NO_MAC:
            raise WireError(f"{peer.describe()} sent unknown handshake flags {peer.flags:#x}")
        sock.settimeout(timeout)
    except BaseException as exc:
        log.debug("handshake with %s failed: %s", where, exc)
        close_socket(sock)
        raise
    log.debug("authenticated %s (role %d)", peer.describe(), peer.role)
    return Channel(sock, keys=keys, rank=rank, world=world, peer=peer, timeout=timeout,
                   max_frame=max_frame, mac=not benchmark_only_disable_mac)


def _configure(sock: socket.socket) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


def close_socket(sock: socket.socket) -> None:
    """Shut a socket down, then close it, ignoring errors.

    ``shutdown()`` first: closing the descriptor alone does not wake a thread
    blocked reading it (a handshake in progress would wait out its timeout).
    """
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


# ----------------------------------------------------------------------------- channel


_HAS_POLL = hasattr(select, "poll")
_MAX_POLL_MS = 2**31 - 1


class _Poller:
    """Waits until a non-blocking socket is readable (or writable)."""

    def __init__(self, sock: socket.socket, *, write: bool = False) -> None:
        self._sock = sock
        self._write = write
        self._poll: Any = None
        if _HAS_POLL:
            self._poll = select.poll()
            self._poll.register(sock, select.POLLOUT if write else select.POLLIN | select.POLLPRI)

    def wait(self, timeout: float | None) -> bool:
        """True when ready (or in error: the next call reports it), False on timeout."""
        try:
            if self._poll is not None:
                # poll() takes at most 2**31 - 1 ms (24.8 days); a longer
                # timeout (1e9 s meaning "for ever") just polls that long.
                ms = None if timeout is None else int(min(max(timeout, 0.0) * 1000 + 0.999,
                                                          _MAX_POLL_MS))
                return bool(self._poll.poll(ms))
            if self._write:
                return bool(select.select([], [self._sock], [], timeout)[1])
            return bool(select.select([self._sock], [], [], timeout)[0])
        except (OSError, ValueError):
            return True  # a closed socket: let the read or write say what happened


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
    nbytes: int = 0
    #: The raw body (a numpy uint8 array the state's arrays are views of).
    body: Any = attrs.field(default=None, repr=False, eq=False)
    flags: int = 0


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
                 timeout: float, max_frame: int, mac: bool = True) -> None:
        self._sock = sock
        self._keys = keys
        self.rank = rank
        self.world = world
        self.peer = peer
        self._timeout = timeout
        self.max_frame = max_frame
        self.mac_enabled = mac
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._send_seq = 0
        self._recv_seq = 0
        self._closed = False
        self._close_reason: str | None = None
        self._pool: list[np.ndarray] = []
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
        self._pool = []  # recycled receive buffers are not needed any more

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
        return self._send_buffers(kind, tag, encoded.flags, encoded,
                                  self.rank if sender is None else sender, deadline)

    def forward(self, frame: Frame, *, sender: int | None = None,
                deadline: float | None = None) -> int:
        """Re-send a received frame's body unchanged (for relays: no re-encoding).

        The body tag is recomputed under this channel's key and sequence
        number: tags are per connection and per direction.
        """
        encoded = EncodedState(buffers=(frame.body,), nbytes=frame.nbytes, flags=frame.flags)
        return self._send_buffers(frame.kind, frame.tag, frame.flags, encoded,
                                  frame.sender if sender is None else sender, deadline)

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

    def _room_for(self, nbytes: int) -> bool:
        """Whether the kernel takes ``nbytes`` more right now: the bytes already
        queued plus these fit in half the send buffer (the other half covers
        the kernel's per-packet overhead). False whenever it cannot tell."""
        if _OUTQ_REQUEST is None:
            return False
        try:
            queued = struct.unpack("i", fcntl.ioctl(self._sock.fileno(), _OUTQ_REQUEST,
                                                    b"\0\0\0\0"))[0]
            room = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 2
        except OSError:
            return False
        return queued + nbytes <= room

    def _send_buffers(self, kind: int, tag: int, flags: int, encoded: EncodedState,
                      sender: int, deadline: float | None = None, *,
                      if_room: bool = False) -> int | None:
        # ``if_room``: send only if it cannot wait (see forward_now); None if not sent.
        nbytes = encoded.nbytes
        if not 0 <= kind <= 0xFF:
            raise WireError(f"frame kind must be 0..255, got {kind}")
        if not 0 <= tag <= 0xFFFFFFFF:
            raise WireError(f"frame tag must be 0..{0xFFFFFFFF}, got {tag}")
        if not 0 <= sender <= 0xFFFFFFFF:
            raise WireError(f"frame sender must be a rank >= 0, got {sender}")
        limit = min(self.max_frame, self.peer.max_frame)
        if nbytes > limit:
            raise WireError(f"frame body of {nbytes} bytes exceeds the {limit}-byte ceiling "
                            f"agreed with {self.peer.describe()}; raise max_frame on both ends "
                            "or send the state in parts")
        views = [_byte_view(buf) for buf in encoded.buffers]
        if not self._send_lock.acquire(blocking=not if_room):
            return None
        try:
            if self._closed:
                raise self._closed_error("is")
            if if_room and not self._room_for(HEADER_SIZE + nbytes + BODY_TAG_SIZE):
                return None
            seq = self._send_seq
            head = _HEADER.pack(FRAME_MAGIC, kind, flags, 0, tag, sender, seq, nbytes)
            header = head + (hmac.digest(self._keys.send_header, head, "sha256")
                             if self.mac_enabled else _ZERO_MAC)
            try:
                self._write(header, views, nbytes, seq, deadline)
            except BaseException as exc:
                self.close(str(exc) if isinstance(exc, PeerLostError) else None)
                raise
            self._send_seq = seq + 1
        finally:
            self._send_lock.release()
        return nbytes

    def _tag(self, seq: int, header: bytes, body: list[memoryview]) -> bytes:
        if not self.mac_enabled:
            return _ZERO_TAG
        return _body_tag(self._keys.send_gcm, self._keys.send_body, seq, header, body)

    def _write(self, header: bytes, views: list[memoryview], nbytes: int, seq: int,
               deadline: float | None) -> None:
        if nbytes < _COALESCE:
            # Small frame: one buffer, one tag call over it, one send.
            whole = bytearray(header)
            for view in views:
                whole += view
            with memoryview(whole) as body:
                tag = self._tag(seq, header, [body[HEADER_SIZE:]])
            whole += tag
            self._send_all(memoryview(whole), deadline)
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

    def recv(self, timeout: float | None = _UNSET) -> Frame:
        """Receive the next frame.

        ``timeout`` bounds the wait for a frame to *start* (default: the
        channel's timeout; None waits until a frame arrives or the channel
        closes); expiry raises :class:`RecvTimeout` and leaves the channel
        usable. Once a frame has started, a stall longer than the channel's
        timeout is a :class:`PeerLostError`.
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
                return self._recv_frame(header, got)
            except BaseException:
                self.close()
                raise

    def _read_into(self, view: memoryview, what: str, gmac: Any = None,
                   mac_end: int = 0, got: int = 0) -> None:
        # With ``gmac``, bytes [0, mac_end) are fed to it as they arrive, in
        # pieces of about _MAC_STEP, while they are still in cache. ``got``:
        # bytes already in ``view``.
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
            if gmac is not None and min(got, mac_end) - fed >= _MAC_STEP:
                upto = min(got, mac_end)
                gmac.authenticate_additional_data(view[fed:upto])
                fed = upto
        if gmac is not None and fed < mac_end:
            gmac.authenticate_additional_data(view[fed:mac_end])

    def _receive_buffer(self, size: int) -> np.ndarray:
        """A buffer for one frame: a recycled one nothing references any more, or a new one.

        Reading into memory that was just used keeps a steady stream of
        frames in cache (a fresh allocation is cold, and often page-faulted
        in). A buffer is only recycled once no decoded array, frame or view
        refers to it: numpy views keep their base alive, so the reference
        count says so exactly.
        """
        if not _POOL_MIN <= size <= _POOL_MAX:
            return np.empty(size, dtype=np.uint8)
        pool = self._pool
        for buf in pool:
            # References: the pool's slot, ``buf`` and getrefcount's argument.
            if buf.nbytes == size and sys.getrefcount(buf) <= 3:
                return buf
        buf = np.empty(size, dtype=np.uint8)
        if len(pool) >= _POOL_SIZE:
            pool.pop(0)
        pool.append(buf)
        return buf

    def _recv_frame(self, header: bytearray, got: int) -> Frame:
        self._read_into(memoryview(header), "header", got=got)
        head = bytes(header[:_HEADER.size])
        if self.mac_enabled:
            expected = hmac.digest(self._keys.recv_header, head, "sha256")
            if not hmac.compare_digest(expected, bytes(header[_HEADER.size:])):
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
        if flags & ~_KNOWN_FRAME_FLAGS or reserved:
            raise WireError(f"frame from {self.peer.describe()} has unknown flags {flags:#x}")
        if nbytes > self.max_frame:
            raise WireError(
                f"{self.peer.describe()} announced a frame body of {nbytes} bytes, above this "
                f"node's max_frame of {self.max_frame}; refused before reading it")
        # Only now, with the header authenticated and its length bounded, is
        # anything body-sized allocated. Body and tag arrive in one read.
        whole = self._receive_buffer(nbytes + BODY_TAG_SIZE)
        body = whole[:nbytes]
        if not self.mac_enabled:
            self._read_into(memoryview(whole), "body")
        elif nbytes < _MAC_STEP:
            self._read_into(memoryview(whole), "body")
            expected = _body_tag(self._keys.recv_gcm, self._keys.recv_body, seq, bytes(header),
                                 [memoryview(body)])
        else:
            gmac = _streaming_gmac(self._keys.recv_body, seq)
            self._read_into(memoryview(whole), "body", gmac, nbytes)
            gmac.update(bytes(header))
            gmac.finalize()
            expected = gmac.tag
        if self.mac_enabled:
            if not hmac.compare_digest(expected, whole[nbytes:].tobytes()):
                raise AuthenticationError(
                    f"frame body from {self.peer.describe()} (tag {tag}, {nbytes} bytes) failed "
                    "authentication (forged or corrupted); connection dropped")
        self._recv_seq = seq + 1
        state = decode_state(body, flags=flags)
        return Frame(kind=kind, tag=tag, sender=sender, seq=seq, state=state,
                     bf16=bool(flags & FLAG_BF16), nbytes=nbytes, body=body, flags=flags)


# ----------------------------------------------------------------------------- datagrams

_DATAGRAM_MAGIC = b"MKD\x01"
MAX_DATAGRAM = 65_507


def _datagram_key(secret: bytes) -> bytes:
    prk = _hkdf_extract(_LABEL + b"datagram salt", secret)
    return _hkdf_expand(prk, _LABEL + b"datagram")


def seal_datagram(secret: bytes | None, payload: bytes) -> bytes:
    """``magic | payload | HMAC-SHA256`` under a key derived from ``secret``.

    Replay protection (a nonce or timestamp inside ``payload``) is the
    caller's: a datagram has no connection to hang a sequence number on.
    """
    key = _datagram_key(_check_secret(secret))
    data = _DATAGRAM_MAGIC + bytes(payload)
    if len(data) + MAC_SIZE > MAX_DATAGRAM:
        raise WireError(f"datagram payload of {len(payload)} bytes is too large for UDP")
    return data + hmac.digest(key, data, "sha256")


def open_datagram(secret: bytes | None, datagram: bytes) -> bytes:
    """Return the payload of a sealed datagram or raise WireError/AuthenticationError."""
    key = _datagram_key(_check_secret(secret))
    datagram = bytes(datagram)
    if len(datagram) < len(_DATAGRAM_MAGIC) + MAC_SIZE or not datagram.startswith(_DATAGRAM_MAGIC):
        raise WireError("not a meshkit datagram")
    data, tag = datagram[:-MAC_SIZE], datagram[-MAC_SIZE:]
    if not hmac.compare_digest(hmac.digest(key, data, "sha256"), tag):
        raise AuthenticationError("datagram failed authentication (wrong secret or forged)")
    return data[len(_DATAGRAM_MAGIC):]

