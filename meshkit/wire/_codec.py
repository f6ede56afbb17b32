"""The sans-io codec: what every byte of a hello, a frame header and a body means.

Nothing here touches a socket: the handshake and the channel do the I/O and
use these layouts (``docs/wire.md`` is the byte-level spec). A body is a
tensor table: a count, one entry per state key (kind, dtype, shape, name,
data length), then the data, each piece aligned to 64 bytes.
:func:`decode_state` checks every count, length and shape against the bytes
actually present *before* it allocates or reads anything, and bounds JSON
nesting (``meshkit.state.MAX_JSON_DEPTH``); :func:`encode_state` refuses
anything JSON would silently change. Never pickle, never eval.
"""

from __future__ import annotations

import json
import struct
from collections import abc
from typing import Any, Callable, Mapping

import attrs
import ml_dtypes
import numpy as np

from meshkit.errors import WireError
from meshkit.state import MAX_JSON_DEPTH, json_depth

# Version 2: the body tag is AES-256-GMAC (16 bytes) instead of
# HMAC-SHA256 over the body's SHA-256 (32 bytes).
# Version 3: the hello's nonce is an ephemeral X25519 key whose shared value
# enters the key schedule; bodies are AES-256-GCM encrypted unless both ends
# opt out (HELLO_FLAG_PLAINTEXT); a node may prove an Ed25519 key.
# Version 4: a body above the link's segment size travels as a lead frame and
# its segments (FLAG_SEGMENTED, FLAG_SEGMENT); the hello's former reserved
# field says how big a segment this end wants to receive (issue 39).
# Version 5: a cut transfer resumes: a resumable lead frame (FLAG_RESUMABLE)
# names the transfer and its digest, and a hello flag (HELLO_FLAG_RESUME) says
# an offer of cut transfers follows the handshake (issue 39).
PROTOCOL_VERSION = 5
#: Every MAC on the wire (header, key confirmation, datagram) is HMAC-SHA256.
MAC_SIZE = 32

# ----------------------------------------------------------------------------- hello

HELLO_MAGIC = b"MESHKIT\x00"
SESSION_SIZE = 16
# Hello: magic 8s | version u16 | flags u16 | role u16 | segment u16 | rank u32 |
# world u32 | max_frame u64 | session 16s | nonce 32s   -> 80 bytes.
# ``segment`` is the largest segment this end wants, in SEGMENT_UNIT bytes.
_HELLO = struct.Struct("<8sHHHHIIQ16s32s")
HELLO_SIZE = _HELLO.size
# The first 10 bytes (magic + version) keep this layout in every version, so
# two versions can always tell each other apart before anything else.
_HELLO_PREFIX = 10
HELLO_FLAG_NO_MAC = 0x0001
#: This end sends bodies in clear (tagged only): ``[mesh] encrypt = false``.
HELLO_FLAG_PLAINTEXT = 0x0002
#: This end proves a node key right after the key confirmation.
HELLO_FLAG_NODE_KEY = 0x0004
#: This end offers cut transfers to resume right after the handshake (docs/wire.md §2.5).
HELLO_FLAG_RESUME = 0x0008
_KNOWN_HELLO_FLAGS = (HELLO_FLAG_NO_MAC | HELLO_FLAG_PLAINTEXT | HELLO_FLAG_NODE_KEY
                      | HELLO_FLAG_RESUME)


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
    #: The largest segment of a segmented message this end wants, in bytes.
    segment: int = 0

    def describe(self) -> str:
        where = f" at {self.address}" if self.address else ""
        return f"peer{where} (claims rank {self.rank} of world {self.world})"


# ----------------------------------------------------------------------------- frame header

#: Tags at or above this value belong to the kernel (handshake, reduce, caps).
RESERVED_TAG_BASE = 0xFFFF0000
FRAME_MAGIC = b"MKF\x01"
# Frame header: magic 4s | kind u8 | flags u8 | reserved u16 | tag u32 |
# sender u32 | seq u64 | body_len u64 | header MAC 32s  -> 64 bytes.
_HEADER = struct.Struct("<4sBBHIIQQ")
HEADER_SIZE = _HEADER.size + MAC_SIZE
FLAG_BF16 = 0x01
#: Flags a message's body carries (what :func:`decode_state` reads).
_KNOWN_FRAME_FLAGS = FLAG_BF16
#: A lead frame: its body is :data:`SEGMENT_LEAD` and the message's body
#: follows in that many :data:`FLAG_SEGMENT` frames (docs/wire.md, "Segments").
FLAG_SEGMENTED = 0x02
#: One segment of the body the last lead frame announced: raw body bytes.
FLAG_SEGMENT = 0x04
#: With FLAG_SEGMENTED: a resumable lead, its body :data:`RESUME_LEAD` (docs/wire.md §2.5).
FLAG_RESUMABLE = 0x08
#: A resume offer or answer: only the first frame each way after a handshake
#: whose hello set :data:`HELLO_FLAG_RESUME` (docs/wire.md §2.5).
FLAG_RESUME = 0x10
#: Every flag a frame header may carry after the handshake.
_KNOWN_HEADER_FLAGS = FLAG_BF16 | FLAG_SEGMENTED | FLAG_SEGMENT | FLAG_RESUMABLE
#: A lead frame's body: the message body's bytes u64 | segments u32 | segment size u32.
SEGMENT_LEAD = struct.Struct("<QII")
#: A resumable lead's body: bytes u64 | segments u32 | segment size u32 | transfer id 16s |
#: first segment sent u32 | reserved u32 (0).
RESUME_LEAD = struct.Struct("<QII16sII")
#: A resume offer's entry: transfer id 16s | digest 16s | bytes u64 | segments u32 | size u32.
RESUME_OFFER = struct.Struct("<16s16sQII")
#: A resume answer's entry: transfer id 16s | first segment to send u32 | status u32.
RESUME_ANSWER = struct.Struct("<16sII")
#: An offer or answer body starts with: entries u32 | reserved u32 (0).
RESUME_COUNT = struct.Struct("<II")
#: Segment sizes are announced in the hello in units of this many bytes.
SEGMENT_UNIT = 64 << 10
#: The segment size an end wants unless told otherwise (``[mesh] segment_bytes``).
DEFAULT_SEGMENT_BYTES = 4 << 20
#: The largest segment size a hello can announce (65535 units, just under 4 GiB).
MAX_SEGMENT_BYTES = 0xFFFF * SEGMENT_UNIT
#: Size of the AES-GMAC body tag that follows every frame body.
BODY_TAG_SIZE = 16

# ----------------------------------------------------------------------------- body

MAX_TENSORS = 65_536
MAX_NDIM = 32
MAX_NAME_BYTES = 1024
# Body: count u32 | reserved u32, then per entry: kind u8 | dtype u8 | ndim u8 |
# entry flags u8 | name_len u32 | data_len u64, ndim x u64 dims, name bytes.
_BODY_HEAD = struct.Struct("<II")
_ENTRY = struct.Struct("<BBBBIQ")
_DIM = struct.Struct("<Q")
#: ``_DIMS[n]`` packs or unpacks n dimensions at once.
_DIMS = [struct.Struct(f"<{n}Q") for n in range(MAX_NDIM + 1)]
#: ``_ENTRY_DIMS[n]``: an array entry and its n dimensions in one pack.
_ENTRY_DIMS = [struct.Struct(f"<BBBBIQ{n}Q") for n in range(MAX_NDIM + 1)]
# One encoder for every JSON leaf (json.dumps with options builds one per call).
_JSON_ENCODER = json.JSONEncoder(allow_nan=True, separators=(",", ":"))
#: What that encoder writes for a str (it keeps ``ensure_ascii``).
_JSON_STR = json.encoder.encode_basestring_ascii
#: json's C scanner, the one ``json.loads`` runs under three Python layers:
#: ``(value, end)``, or StopIteration where no value starts. (typeshed does not
#: declare the attribute JSONDecoder.__init__ sets.)
_JSON_SCAN: Callable[[str, int], tuple[Any, int]] = (
    json.JSONDecoder().scan_once)  # type: ignore[attr-defined]
ENTRY_ARRAY = 1
ENTRY_JSON = 2
#: ``_ONE_ARRAY[n]``: the whole table of a body that is one n-dimensional
#: array (count, reserved, the entry, its dims) in one pack or unpack.
_ONE_ARRAY = [struct.Struct(f"<IIBBBBIQ{n}Q") for n in range(MAX_NDIM + 1)]
_ONE_HEAD = struct.Struct("<IIBBBBIQ")
ENTRY_FLAG_WIDEN_F32 = 0x01
DATA_ALIGN = 64
#: Padding, sliced.
_ZEROS = bytes(DATA_ALIGN)
#: An entry's data at least this large travels as its own buffer, a view of the array's
#: memory; smaller data is copied in beside the table (:func:`encode_state`). Not above
#: the ring's ``_LAND_MIN``: a segment it lands in place must be the body's last buffer.
OWN_BUFFER_BYTES = 64 << 10


def _dtype_table() -> dict[int, np.dtype]:
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


def check_segment_bytes(value: Any, what: str = "segment_bytes") -> str | None:
    """What is wrong with ``value`` as a segment size, or None (it is usable).

    A segment size is announced in the hello in units of
    :data:`SEGMENT_UNIT`, so it must be a multiple of it (64 KiB, 1 MiB,
    4 MiB, ...) between one unit and :data:`MAX_SEGMENT_BYTES`.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{what} must be an integer number of bytes, got {value!r}"
    if not SEGMENT_UNIT <= value <= MAX_SEGMENT_BYTES or value % SEGMENT_UNIT:
        return (f"{what} must be a multiple of {SEGMENT_UNIT} (64 KiB) between {SEGMENT_UNIT} "
                f"and {MAX_SEGMENT_BYTES}, e.g. {DEFAULT_SEGMENT_BYTES} (4 MiB); got {value}")
    return None


def _little_endian(dtype: np.dtype) -> np.dtype:
    try:
        return dtype.newbyteorder("<")
    except (TypeError, ValueError):  # extension dtypes (bfloat16) have no byte order to set
        return dtype


def _align(n: int) -> int:
    return (n + DATA_ALIGN - 1) // DATA_ALIGN * DATA_ALIGN


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


def _encode_one_array(state: Mapping[str, Any], bf16: bool) -> EncodedState | None:
    """The body of a one-array state (every pipeline activation frame), or None.

    Same bytes as the general path, in one struct pack; None for anything
    that needs the general path's work or its error messages (another
    dtype or byte order, a non-contiguous or bf16-narrowed array, a bad name).
    """
    ((name, value),) = state.items()
    if type(value) is not np.ndarray or type(name) is not str or not name:
        return None
    code = _CODE_OF.get(value.dtype)
    dims = value.shape
    ndim = len(dims)
    if (code is None or ndim > MAX_NDIM or not value.flags.c_contiguous
            or (bf16 and code == 12)):
        return None
    raw_name = name.encode("utf-8")
    name_len = len(raw_name)
    if name_len > MAX_NAME_BYTES:
        return None
    data = value.reshape(-1).view(np.uint8)
    used = _ONE_HEAD.size + 8 * ndim + name_len
    offset = _align(used)
    table = (_ONE_ARRAY[ndim].pack(1, 0, ENTRY_ARRAY, code, ndim, 0, name_len, data.nbytes, *dims)
             + raw_name + bytes(offset - used))
    return EncodedState(buffers=(table, data), nbytes=offset + data.nbytes,
                        flags=FLAG_BF16 if bf16 else 0)


def _json_text(name: str, value: Any) -> bytes:
    """A JSON entry's bytes (the general path: containers, subclasses, non-finite floats)."""
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
    return text


#: State keys this process has put on the wire, checked, and their UTF-8 bytes (a
#: round's messages repeat their keys; bounded: cleared when full).
_NAMES: dict[str, bytes] = {}
_NAMES_MAX = 4096


def _checked_name(name: Any) -> bytes:
    """A state key's UTF-8 bytes, or the error saying why it cannot be one."""
    if type(name) is not str and not isinstance(name, str) or not name:
        raise WireError(f"state keys must be non-empty str, got {name!r} "
                        f"({type(name).__name__})")
    raw_name = name.encode("utf-8")
    if len(raw_name) > MAX_NAME_BYTES:
        raise _entry_error(name[:64] + "...", f"its name is {len(raw_name)} bytes of UTF-8, "
                           f"the limit is {MAX_NAME_BYTES}")
    if type(name) is str:
        if len(_NAMES) >= _NAMES_MAX:
            _NAMES.clear()
        _NAMES[name] = raw_name
    return raw_name


def encode_state(state: Mapping[str, Any], *, bf16: bool = False) -> EncodedState:
    """Lay ``state`` out as a frame body without copying the data of large arrays.

    The table and every entry under :data:`OWN_BUFFER_BYTES` are one buffer; each
    larger array is a buffer of its own, a view of its memory.

    Arrays must have one of the dtypes in :data:`DTYPE_CODES`; everything
    else must be a JSON value (number, str, bool, None, list, dict). With
    ``bf16``, float32 arrays are narrowed to bfloat16 (round to nearest even)
    and marked to be widened back to float32 by the receiver.
    """
    # typing.Mapping's isinstance check costs microseconds; a plain dict none.
    if type(state) is not dict and not isinstance(state, abc.Mapping):
        raise WireError(f"a state must be a mapping of names to arrays or JSON values, "
                        f"got {type(state).__name__}")
    if len(state) == 1:
        encoded = _encode_one_array(state, bf16)
        if encoded is not None:
            return encoded
    if len(state) > MAX_TENSORS:
        raise WireError(f"a state may carry at most {MAX_TENSORS} entries, got {len(state)}")
    table = bytearray(_BODY_HEAD.pack(len(state), 0))
    # Small entries' data (JSON fields, arrays under OWN_BUFFER_BYTES) is copied in after
    # the table, so a request or a small model is one buffer, not two an entry: the
    # channel joined them into one for its single AEAD call anyway, and a buffer each
    # cost the encoder and the channel Python work an entry (issue 36). A larger
    # array is its own buffer, a view of its memory, never copied. Each run of small
    # pieces is joined once, at the end: the table (a bytearray, grown in place) heads
    # the first. Data starts 64-byte aligned, so each piece's padding is known as it
    # is laid out (``at``: bytes since the data's start).
    run: list[Any] = [table]
    runs: list[tuple[list[Any], Any]] = []  # a run of small pieces, the large array after it
    at = pad = 0
    for name, value in state.items():
        raw_name = _NAMES.get(name) if type(name) is str else None
        if raw_name is None:
            raw_name = _checked_name(name)
        name_len = len(raw_name)
        kind = type(value)
        if kind is np.ndarray or isinstance(value, np.ndarray):
            dims = value.shape
            ndim = len(dims)
            if ndim > MAX_NDIM:
                raise _entry_error(name, f"{ndim} dimensions, the limit is {MAX_NDIM}")
            if bf16 and value.dtype.kind == "f" and value.dtype.itemsize == 4:
                array, eflags = value.astype(_BF16), ENTRY_FLAG_WIDEN_F32
            else:
                array, eflags = value, 0
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
            nbytes = data.nbytes
            table += _ENTRY_DIMS[ndim].pack(ENTRY_ARRAY, code, ndim, eflags, name_len, nbytes,
                                            *dims) + raw_name
            if nbytes < OWN_BUFFER_BYTES:
                # (Its memoryview: bytes.join of an ndarray would iterate its elements.)
                run.append(data.data)
            else:
                runs.append((run, data))
                run = []
        else:
            # A request's scalar fields (op, seq, keep, ...) as the encoder writes them, without
            # its Python layers (issue 36): a str as encode_basestring_ascii does (the encoder's
            # ensure_ascii), an int or a float as its repr (NaN and the infinities as
            # allow_nan writes them), True, False and None as JSON's words.
            if kind is str:
                text = _JSON_STR(value).encode("ascii")
            elif kind is int:
                text = int.__repr__(value).encode("ascii")
            elif kind is bool:
                text = b"true" if value else b"false"
            elif value is None:
                text = b"null"
            elif kind is float and value - value == 0.0:  # finite
                text = float.__repr__(value).encode("ascii")
            else:
                text = _json_text(name, value)
            nbytes = len(text)
            table += _ENTRY.pack(ENTRY_JSON, 0, 0, 0, name_len, nbytes) + raw_name
            run.append(text)
        at += nbytes
        pad = -at % DATA_ALIGN
        if pad:
            run.append(_ZEROS[:pad])
            at += pad
    if pad:  # the last entry's data ends the body: no padding after it
        run.pop()
        at -= pad
    offset = _align(len(table)) if state else len(table)
    table += _ZEROS[:offset - len(table)]
    offset += at
    buffers: list[Any] = []
    for small, large in runs:
        buffers.append(b"".join(small))
        buffers.append(large)
    if run:
        buffers.append(b"".join(run))
    return EncodedState(buffers=tuple(buffers), nbytes=offset,
                        flags=FLAG_BF16 if bf16 else 0)


def _decode_one_array(buf: np.ndarray, mv: memoryview, size: int) -> dict[str, Any] | None:
    """The state of a well-formed one-array body (every activation frame), or None.

    Checks everything the general path checks for such a body, against the
    bytes present, before it reads data; anything else (another shape of
    body, a bool or bf16-widened array, any inconsistency) is None and goes
    to the general path, which decodes it or says what is wrong.
    """
    count, reserved, kind, code, ndim, eflags, name_len, data_len = _ONE_HEAD.unpack_from(mv, 0)
    if count != 1 or reserved or kind != ENTRY_ARRAY or eflags or ndim > MAX_NDIM:
        return None
    dtype = DTYPE_CODES.get(code)
    # bool arrays need their bytes checked: the general path does that.
    if dtype is None or code == 1 or name_len > MAX_NAME_BYTES:
        return None
    pos = _ONE_HEAD.size + 8 * ndim
    end = pos + name_len
    offset = _align(end)
    if offset + data_len != size:
        return None
    dims = _DIMS[ndim].unpack_from(mv, _ONE_HEAD.size)
    elements = 1
    for d in dims:
        elements *= d  # Python ints: no overflow however large the claim
    if elements * dtype.itemsize != data_len:
        return None
    try:
        name = bytes(mv[pos:end]).decode("utf-8")
        return {name: buf[offset:size].view(dtype).reshape(dims)}
    except (UnicodeDecodeError, ValueError):
        return None


def _table_error(index: int, kind: int, ndim: int, name_len: int, data_len: int,
                 size: int) -> WireError:
    """What is wrong with a table entry whose kind, ndim, name or data length is out of bounds."""
    if kind not in (ENTRY_ARRAY, ENTRY_JSON):
        return WireError(f"entry {index}: unknown entry kind {kind} "
                         "(expected 1 array or 2 JSON)")
    if ndim > MAX_NDIM:
        return WireError(f"entry {index}: {ndim} dimensions, the limit is {MAX_NDIM}")
    if name_len > MAX_NAME_BYTES:
        return WireError(f"entry {index}: name of {name_len} bytes, "
                         f"the limit is {MAX_NAME_BYTES}")
    return WireError(f"entry {index}: claims {data_len} bytes of data in a {size}-byte body")


def _json_value(raw: bytes) -> Any:
    """A JSON entry's value, as ``json.loads`` reads it (ValueError, RecursionError).

    A request's scalar fields (op, seq, keep, ...) are most of a round's
    entries: json's scanner reads them without ``json.loads``' layers (issue
    36). Anything it does not take whole (whitespace around the value, not
    JSON at all) goes to ``json.loads``, which reads it or says what is wrong.
    """
    text = raw.decode("utf-8")
    try:
        value, end = _JSON_SCAN(text, 0)
        if end == len(text):
            return value
    except StopIteration:
        pass
    return json.loads(text)


#: Tables this process decoded whole, by their bytes: the body's size and each entry's
#: (name, dtype or None for JSON, dims, offset, end, check). Decoding a table reads
#: nothing but its bytes and the body's size, so a body whose table bytes and size equal
#: a cached one has those entries at those offsets, every bound already checked: its
#: decode skips the walk (a round's requests and replies repeat their tables; issue 36).
#: Only a table a full decode accepted is cached; bounded (cleared when full).
_LAYOUTS: dict[bytes, tuple[int, tuple[tuple[Any, ...], ...]]] = {}
#: The length of the table last cached for each entry count: where to cut a body's
#: table to look it up (a table's length is its names' and shapes', not its data's).
_TABLE_LENGTHS: dict[int, int] = {}
_LAYOUTS_MAX = 64
#: At most this many bytes of tables are kept (a layout's Python objects take about
#: six times its table's bytes: a few MB in all), so a peer sending ever-new tables
#: cannot grow it; a table over a quarter of it (thousands of entries) is not kept.
_LAYOUT_BYTES_MAX = 1 << 20
#: An array entry's data check: none, its bytes are bools, it is widened to float32.
_PLAIN, _BOOL, _WIDEN = 0, 1, 2


def _json_entry(name: str, raw: bytes) -> Any:
    """A JSON entry's value, or the :class:`WireError` saying what is wrong with it."""
    try:
        value = _json_value(raw)
    except (ValueError, RecursionError) as exc:
        raise WireError(f"entry {name!r}: invalid JSON ({type(exc).__name__})") from None
    # Bounded like every other count: whatever walks it later (a fold,
    # validation) recurses, and must not be driven past the stack.
    if isinstance(value, (list, dict)) and json_depth(value) > MAX_JSON_DEPTH:
        raise WireError(f"entry {name!r}: JSON nested more than {MAX_JSON_DEPTH} levels deep")
    return value


def _bool_error(name: str) -> WireError:
    return WireError(f"entry {name!r}: a bool array holds bytes other than 0 and 1")


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
    mv = buf.data  # its memoryview (numpy's 3.11 stubs lack ndarray.__buffer__)
    if size < _BODY_HEAD.size:
        raise WireError(f"frame body of {size} bytes is shorter than its {_BODY_HEAD.size}-byte "
                        "tensor-table header")
    if size >= _ONE_HEAD.size and not flags & ~_KNOWN_FRAME_FLAGS:
        one = _decode_one_array(buf, mv, size)
        if one is not None:
            return one
    count, reserved = _BODY_HEAD.unpack_from(mv, 0)
    known = _TABLE_LENGTHS.get(count)
    if known is not None:
        seen = _LAYOUTS.get(bytes(mv[:known]))
        if seen is not None and seen[0] == size:
            return _decode_laid_out(buf, mv, seen[1], flags)
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
        if (kind != ENTRY_ARRAY and kind != ENTRY_JSON or ndim > MAX_NDIM
                or name_len > MAX_NAME_BYTES or data_len > size):
            raise _table_error(index, kind, ndim, name_len, data_len, size)
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
    table_end = pos
    offset = _align(pos) if entries else pos
    state: dict[str, Any] = {}
    layout: list[tuple[Any, ...]] = []
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
            check = (_BOOL if code == 1 and data_len
                     else _WIDEN if eflags & ENTRY_FLAG_WIDEN_F32 else _PLAIN)
            if check == _BOOL and int(buf[offset:end].max()) > 1:
                raise _bool_error(name)
            if check == _WIDEN:
                array = array.astype(_F32)
            state[name] = array
            layout.append((name, dtype, dims, offset, end, check))
        else:
            state[name] = _json_entry(name, bytes(mv[offset:end]))
            layout.append((name, None, dims, offset, end, _PLAIN))
        offset = end if i + 1 == len(entries) else _align(end)
    if offset != size:
        raise WireError(f"frame body is {size} bytes but its table accounts for {offset}")
    if flags & ~_KNOWN_FRAME_FLAGS:
        raise WireError(f"unknown frame flags {flags:#x}")
    if table_end <= _LAYOUT_BYTES_MAX // 4:
        try:
            full = (len(_LAYOUTS) >= _LAYOUTS_MAX
                    or sum(map(len, _LAYOUTS)) + table_end > _LAYOUT_BYTES_MAX)
        except RuntimeError:  # another thread changed the cache meanwhile (free-threaded)
            full = True
        if full:
            _LAYOUTS.clear()
            _TABLE_LENGTHS.clear()
        _LAYOUTS[bytes(mv[:table_end])] = (size, tuple(layout))
        _TABLE_LENGTHS[count] = table_end
    return state


def _decode_laid_out(buf: np.ndarray, mv: memoryview, layout: tuple[tuple[Any, ...], ...],
                     flags: int) -> dict[str, Any]:
    """A body whose table a full decode accepted (:data:`_LAYOUTS`): its data, checked as
    :func:`decode_state` checks it (bool bytes, JSON), in the same order."""
    state: dict[str, Any] = {}
    for name, dtype, dims, offset, end, check in layout:
        if dtype is not None:
            array = buf[offset:end].view(dtype).reshape(dims)
            if check:
                if check == _WIDEN:
                    array = array.astype(_F32)
                elif int(buf[offset:end].max()) > 1:
                    raise _bool_error(name)
            state[name] = array
        else:
            state[name] = _json_entry(name, bytes(mv[offset:end]))
    if flags & ~_KNOWN_FRAME_FLAGS:
        raise WireError(f"unknown frame flags {flags:#x}")
    return state
