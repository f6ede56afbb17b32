"""The mesh all-reduce: a weighted mean computed by the participants themselves, no coordinator fold.

The rule: every rank in ``ranks`` calls :meth:`Group.mesh_all_reduce` with the
same ``ranks``, the same keys, shapes and dtypes, and its own weight, in the
same order as every other collective over those ranks; each gets back
``sum_i w_i x_i / sum_i w_i`` in each array's own dtype. Only floating
arrays take part (float16, bfloat16, float32 accumulate in float32; float64
in float64): a count or a JSON value has no mean that a sum could give, so
it is refused, as is a layout that differs between ranks
(:class:`~meshkit.AggregationError` on every participant, naming the keys).

How, in two steps:

* **Pack** (:func:`pack`): the state becomes one flat buffer per
  accumulation dtype, each contribution scaled by its weight, with the
  weight itself in the buffer's last slot, so one sum gives both the
  numerator and the mass it divides by.
* **Sum**: the transport's own collective when it offers one
  (:meth:`Links.all_reduce_sum`: ``torchdist`` hands the buffer to
  torch.distributed), else a ring over the direct links (:func:`ring_sum`):
  reduce-scatter, then all-gather, ``n - 1`` steps each, every rank sending
  and receiving ``(n - 1) / n`` of the buffer per phase at the same time (the
  bandwidth-optimal schedule of Patarasuk & Yuan, 2009). A chunk travels in
  segments of under 4 MiB (:func:`segments`), and the chunk a step receives
  is the one the next step sends, so each segment is added into place and
  posted onward at once, a sender thread writing it while the next one
  arrives: encryption, transfer, decryption and the add pipeline. The ring
  makes no packing pass: each segment's own share is read from the state
  (:func:`contribution`) when the ring first needs it. Every segment is an
  ordinary message under :data:`TAG_RING`, so on ``tcp`` it is
  authenticated and encrypted like every frame. When the links can receive
  a frame into place (``receive_into``: ``tcp``'s mesh), the ring names
  beforehand every segment it will take from the previous rank
  (:class:`_Landing`, a :class:`meshkit.wire.Placer`): the body of a
  reduce-scatter segment is read, decrypted and authenticated straight in
  the segment's place in the output, and this rank's share is added to it
  there once its tag has been checked; an all-gather segment lands where the
  result needs it, so it is never copied at all.

The same ring sums integer arrays exactly in their own dtype, or keeps their
elementwise max (:meth:`Collective.exact_sum`, ``Group.mesh_sum``: DiLoCo's
codes), under its own tag and numbered by the caller's step.

A participant that is lost, stalls past the timeout (per step), or
disagrees on the layout makes the collective fail on *every* participant:
the rank that notices sends an abort to all the others before raising, and a
rank waiting on a chunk also wakes when the rank it waits on is declared dead. A
failed all-reduce never returns a partial sum.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import queue
import struct
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from meshkit.errors import AggregationError, MeshError, PeerLostError, ProtocolError
from meshkit.transport._contract import Links
from meshkit.transport._ledger import Ledger
from meshkit.transport._mailbox import Mailboxes
from meshkit.transport._message import Message, check_state
from meshkit.transport.tags import TAG_RING, TAG_RING_SUM
from meshkit.wire import encode_state

__all__ = ["SEGMENT_BYTES", "Collective", "Layout", "contribution", "layout_bytes",
           "layout_digest", "pack", "ring_sum", "segments", "unpack"]


def _accumulation_dtype(key: str, value: Any) -> np.dtype:
    if not isinstance(value, np.ndarray):
        raise AggregationError(
            f"mesh_all_reduce: {key!r} is a {type(value).__name__}; only floating arrays "
            f"have a mean a sum can give (send counts and JSON values with send/recv)")
    if value.dtype == np.float64:
        return np.dtype(np.float64)
    if value.dtype.kind == "f" or value.dtype.name == "bfloat16":
        return np.dtype(np.float32)
    raise AggregationError(
        f"mesh_all_reduce: {key!r} is {value.dtype}; only floating arrays (float16, "
        f"bfloat16, float32, float64) are averaged, so an integer buffer must travel "
        f"another way (send/recv)")


@attrs.frozen
class Layout:
    """Where each key lives in the packed buffers, and what every rank must agree on."""

    #: (key, buffer index, offset, shape, dtype) per key, in key order.
    entries: tuple[tuple[str, int, int, tuple[int, ...], np.dtype], ...]
    #: The accumulation dtype of each buffer.
    dtypes: tuple[np.dtype, ...]
    #: The length of each buffer (the weight slot included in buffer 0).
    sizes: tuple[int, ...]
    #: A 63-bit digest of the keys, shapes and dtypes (and the ranks): equal on
    #: every participant, or the sum would add unrelated numbers.
    check: int

    def describe(self) -> str:
        return ", ".join(f"{k} {d}{list(s)}" for k, _, _, s, d in self.entries) or "(empty)"


def layout_bytes(entries: Sequence[tuple[str, Sequence[int], Any]],
                 ranks: Sequence[int]) -> bytes:
    """The canonical bytes a ring's layout digest is taken over (docs/protocol.md §5.1).

    Every integer is an unsigned 64-bit little-endian number; a string is
    its UTF-8 length, then its UTF-8 bytes. In order: the number of
    entries; per entry, sorted by key (UTF-8 byte order), the key, the dtype
    name (``float16``, ``bfloat16``, ``float32``, ``float64``), the number of
    dimensions and each dimension; then the number of ranks and each rank.
    Any language computes these bytes without Python's ``repr``.
    """
    out = [_U64.pack(len(entries))]
    # Python orders strings by code point, which is the order of their UTF-8 bytes.
    for key, shape, dtype in sorted(entries, key=lambda e: e[0]):
        raw = key.encode()
        name = _DTYPE_BLOBS.get(dtype)
        if name is None:
            text = np.dtype(dtype).name.encode()
            name = _DTYPE_BLOBS[dtype] = _U64.pack(len(text)) + text
        dims = _DIMS.get(len(shape))
        if dims is None:
            dims = _DIMS[len(shape)] = struct.Struct(f"<{len(shape) + 1}Q")
        out += (_U64.pack(len(raw)), raw, name, dims.pack(len(shape), *shape))
    out.append(struct.pack(f"<{len(ranks) + 1}Q", len(ranks), *ranks))
    return b"".join(out)


def layout_digest(entries: Sequence[tuple[str, Sequence[int], Any]],
                  ranks: Sequence[int]) -> int:
    """A layout's check: BLAKE2b-64 of :func:`layout_bytes`, read little-endian, shifted
    right by one (63 bits, so it is a non-negative signed 64-bit integer too)."""
    digest = hashlib.blake2b(layout_bytes(entries, ranks), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


_U64 = struct.Struct("<Q")
#: Per dtype, its name as layout_bytes writes it; per dimension count, its Struct.
_DTYPE_BLOBS: dict[Any, bytes] = {}
_DIMS: dict[int, struct.Struct] = {}


def pack(state: Mapping[str, Any], weight: float, ranks: Sequence[int],
         empty: Callable[[int, np.dtype], np.ndarray] = np.empty, *,
         fill: bool = True) -> tuple[Layout, list[np.ndarray]]:
    """``state`` scaled by ``weight`` into flat buffers, the weight in buffer 0's last slot.

    ``empty(size, dtype)`` gives each buffer (a fresh one by default;
    :class:`Collective` recycles buffers nothing refers to any more). With
    ``fill=False`` the buffers are left as ``empty`` gave them, for the ring
    to fill segment by segment (:func:`contribution`) as it first needs each.
    """
    groups: dict[np.dtype, list[tuple[str, Any]]] = {}
    for key in sorted(state):
        value = state[key]
        groups.setdefault(_accumulation_dtype(key, value), []).append((key, value))
    # float32 first: its buffer carries the weight when there is one.
    dtypes = sorted(groups, key=lambda d: d.itemsize) or [np.dtype(np.float32)]
    entries = []
    sizes = []
    for index, dtype in enumerate(dtypes):
        offset = 0
        for key, value in groups.get(dtype, []):
            entries.append((key, index, offset, tuple(value.shape), value.dtype))
            offset += value.size
        sizes.append(offset + (1 if index == 0 else 0))
    entries.sort(key=lambda e: e[0])
    layout = Layout(tuple(entries), tuple(dtypes), tuple(sizes),
                    layout_digest([(k, s, d) for k, _, _, s, d in entries], ranks))
    buffers = [empty(size, dtype) for size, dtype in zip(layout.sizes, layout.dtypes)]
    if fill:
        own = contribution(layout, state, weight)
        for b, buffer in enumerate(buffers):
            source = own(b, 0, len(buffer), buffer)
            if source is not None:
                buffer[...] = source
    return layout, buffers


#: ``own(b, lo, hi, out)``: this rank's scaled contribution to buffer ``b``'s
#: elements ``[lo, hi)``: either an array to read it from (the state's own
#: memory, when no scaling or conversion is needed) or None, having written it
#: into ``out`` (that range of the buffer).
Own = Callable[[int, int, int, np.ndarray], "np.ndarray | None"]


def contribution(layout: Layout, state: Mapping[str, Any], weight: float) -> Own:
    """What :func:`pack` would put in any range of the buffers, computed for that range only.

    The ring asks for a segment's share right before it adds the previous
    rank's segment to it, so the state is read once, while the segment is in
    cache, instead of copied into the buffers in a pass of its own first.
    """
    flats: list[list[tuple[int, np.ndarray]]] = [[] for _ in layout.sizes]
    for key, index, offset, _, _ in layout.entries:
        flat = np.ravel(state[key])  # a view unless the array is not contiguous
        if flat.size:
            flats[index].append((offset, flat))
    for pieces in flats:
        pieces.sort(key=lambda p: p[0])
    starts = [[offset for offset, _ in pieces] for pieces in flats]
    slot = layout.sizes[0] - 1  # the weight's slot in buffer 0

    def own(b: int, lo: int, hi: int, out: np.ndarray) -> np.ndarray | None:
        pieces = flats[b]
        j = max(bisect.bisect_right(starts[b], lo) - 1, 0)
        if (weight == 1.0 and j < len(pieces) and not (b == 0 and lo <= slot < hi)):
            offset, flat = pieces[j]
            if offset <= lo and hi <= offset + flat.size and flat.dtype == out.dtype:
                return flat[lo - offset:hi - offset]  # the state itself: nothing to copy
        while j < len(pieces) and pieces[j][0] < hi:
            offset, flat = pieces[j]
            a, z = max(lo, offset), min(hi, offset + flat.size)
            if a < z:
                target = out[a - lo:z - lo]
                if weight != 1.0 and flat.dtype == target.dtype:
                    np.multiply(flat[a - offset:z - offset], weight, out=target)
                else:
                    target[...] = flat[a - offset:z - offset]
                    if weight != 1.0:
                        target *= weight
            j += 1
        if b == 0 and lo <= slot < hi:
            out[slot - lo] = weight
        return None

    return own


def unpack(layout: Layout, buffers: Sequence[np.ndarray]) -> dict[str, Any]:
    """The summed buffers divided by the summed weight, each key in its own dtype and shape."""
    mass = float(buffers[0][-1])
    if not mass > 0 or not math.isfinite(mass):
        raise AggregationError(
            f"mesh_all_reduce: the participants' weights sum to {mass}; a mean needs a "
            f"positive total weight (the realized work, e.g. examples seen)")
    out: dict[str, Any] = {}
    for key, index, offset, shape, dtype in layout.entries:
        size = math.prod(shape)
        segment = buffers[index][offset:offset + size]
        np.divide(segment, mass, out=segment)
        value = segment.reshape(shape)
        out[key] = value if value.dtype == dtype else value.astype(dtype)
    return out


#: ``send(dst, payload)`` and ``take() -> (src, payload)`` as the ring sees them.
Send = Callable[[int, Mapping[str, Any]], None]
Take = Callable[[], tuple[int, Mapping[str, Any]]]

#: A chunk bigger than this travels in segments of at most this many bytes, so
#: the ring pipelines: while a rank adds segment k, its sender thread encrypts
#: and writes segment k - 1 and its reader thread receives and decrypts
#: segment k + 1. Just under 4 MiB so that a segment's frame still fits the
#: channel's recycled receive buffers (wire ``_POOL_MAX``); 1 and 2 MiB
#: measured slower, the frames' fixed costs adding up (docs/benchmarks.md).
SEGMENT_BYTES = (4 << 20) - 4096


def segments(buffers: Sequence[np.ndarray], n: int,
             segment_bytes: int = SEGMENT_BYTES) -> list[list[tuple[int, int, int]]]:
    """Per chunk ``c`` of ``n``: its (buffer, start, stop) segments, in the order they travel.

    Chunk ``c`` of each buffer is elements ``[len * c // n, len * (c + 1) // n)``;
    each is cut into the fewest near-equal segments of at most
    ``segment_bytes``. A chunk empty in every buffer still has one (empty)
    segment, so every step moves at least one frame and a layout mismatch is
    always seen.
    """
    if segment_bytes < 1:
        raise ValueError(f"segment_bytes must be positive, got {segment_bytes}")
    plan: list[list[tuple[int, int, int]]] = []
    for c in range(n):
        chunk: list[tuple[int, int, int]] = []
        for b, buffer in enumerate(buffers):
            lo, hi = len(buffer) * c // n, len(buffer) * (c + 1) // n
            if hi == lo:
                continue
            pieces = -(-(hi - lo) * buffer.itemsize // segment_bytes)
            chunk.extend((b, lo + (hi - lo) * k // pieces, lo + (hi - lo) * (k + 1) // pieces)
                         for k in range(pieces))
        plan.append(chunk or [(0, 0, 0)])
    return plan


#: Segments smaller than this are received as ordinary frames: landing one in
#: place costs a read more than it saves.
_LAND_MIN = 64 << 10


def _segment(round_: int, check: int, c: int, phase: str, k: int,
             x: np.ndarray) -> dict[str, Any]:
    """The payload of one ring segment (the sender's, and what :class:`_Landing` expects)."""
    return {"r": round_, "check": check, "c": c, "phase": phase, "k": k, "x": x}


class _Landing:
    """The segments a rank expects from the previous one, by the head of their frame body.

    A :class:`meshkit.wire.Placer`: for every segment it will take, the ring
    computes the exact bytes that precede the segment's data in the body (its
    round, layout check, chunk, phase and index, encoded as the sender
    encodes them) and the place in the output that data belongs. A frame
    whose head is one of those is received straight into that place; any
    other (a stale round's, a layout that differs, an abort) is received as
    usual and judged by the ring. Each head matches once.
    """

    def __init__(self) -> None:
        self._by_head: dict[bytes, tuple[np.ndarray, dict[str, Any]]] = {}
        #: body length -> head length (0 when two expected heads disagree).
        self._head_sizes: dict[int, int] = {}

    def expect(self, payload: dict[str, Any], target: np.ndarray) -> None:
        encoded = encode_state(payload)
        head = b"".join(bytes(piece) for piece in encoded.buffers[:-1])
        if encoded.nbytes != len(head) + target.nbytes or encoded.flags:
            return  # not laid out as head + data: let it arrive as usual
        known = self._head_sizes.setdefault(encoded.nbytes, len(head))
        if known != len(head):
            self._head_sizes[encoded.nbytes] = 0
        self._by_head[head] = (target, payload)

    def head_size(self, tag: int, flags: int, nbytes: int) -> int:
        return 0 if flags else self._head_sizes.get(nbytes, 0)

    def place(self, head: bytes) -> tuple[np.ndarray, dict[str, Any]] | None:
        return self._by_head.pop(head, None)


#: Buffers of at least _SPARE_MIN bytes are kept for reuse, the last _SPARE_KEEP of them.
_SPARE_MIN = 1 << 20
_SPARE_KEEP = 4


class _Sender:
    """The frames a rank sends, in order: on its own thread once the ring is segmented.

    With one segment per chunk a step's send can only follow the previous
    step's receive, so sending inline loses nothing. With several, a thread
    lets a segment's encryption and write overlap the next one's add. A send
    that fails ends the thread and calls ``interrupt`` (which wakes the
    ring's receive); :meth:`finish` waits for the last frame to be written,
    since the caller then reuses the buffers the frames are views of.
    """

    def __init__(self, send: Callable[[Mapping[str, Any]], None], threaded: bool,
                 interrupt: Callable[[BaseException], None] | None, name: str) -> None:
        self._send = send
        self._interrupt = interrupt
        self._error: BaseException | None = None
        self._stopped = False
        self._queue: queue.SimpleQueue[Mapping[str, Any] | None] | None = None
        self._thread: threading.Thread | None = None
        if threaded:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    def post(self, frame: Mapping[str, Any]) -> None:
        if self._error is not None:
            raise self._error
        if self._queue is None:
            self._send(frame)
        else:
            self._queue.put(frame)

    def _run(self) -> None:
        assert self._queue is not None
        while (frame := self._queue.get()) is not None:
            if self._stopped:
                continue  # the ring failed: drain without sending
            try:
                self._send(frame)
            except BaseException as exc:  # noqa: BLE001 (handed to the ring's thread)
                self._error = exc
                self._stopped = True
                if self._interrupt is not None:
                    self._interrupt(exc)

    def finish(self) -> None:
        """Wait until every posted frame is written; raise the send's error if one failed."""
        if self._thread is not None:
            assert self._queue is not None
            self._queue.put(None)
            self._thread.join()
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        """Send nothing more (the ring failed); returns without waiting for the thread."""
        self._stopped = True
        if self._queue is not None:
            self._queue.put(None)


def ring_sum(buffers: Sequence[np.ndarray], ranks: Sequence[int], me: int, check: int,
             round_: int, send: Send, take: Take, *, segment_bytes: int | None = None,
             interrupt: Callable[[BaseException], None] | None = None,
             own: Own | None = None,
             receive_into: Callable[[_Landing], Callable[[], None] | None] | None = None,
             op: str = "sum") -> None:
    """Sum ``buffers`` in place over ``ranks``: ring reduce-scatter, then ring all-gather.

    Each buffer is cut into ``n`` chunks; at step ``s`` of the reduce-scatter
    rank ``i`` sends chunk ``i - s`` to the next rank and adds chunk
    ``i - s - 1`` from the previous one, so after ``n - 1`` steps it holds
    chunk ``i + 1`` summed over every rank; the all-gather then passes the
    summed chunks round the ring. The chunk a step receives is the one the
    next step sends, so each received segment (see :func:`segments`) is added
    (or copied) into place and at once posted onward: the sends run on a
    thread of their own when a chunk has several segments. ``take`` returns
    the next message from a participant (the caller turns aborts and losses
    into errors); ``interrupt`` is how a failed send on that thread wakes it.
    With ``own`` (:func:`contribution`) the buffers start unfilled: each
    segment's own share is read from the state as the ring first needs it
    (chunk ``i`` is sent straight from it and every other chunk is added to
    it on arrival, so no separate packing pass is made). ``op = "max"`` keeps the
    elementwise largest instead of the sum (exact in any dtype, like an integer sum).
    A segment of an earlier ``round_`` is dropped; one of another round from the
    previous rank is a :class:`MeshError`.
    """
    combine = {"sum": np.add, "max": np.maximum}[op]
    n = len(ranks)
    i = ranks.index(me)
    nxt, prv = ranks[(i + 1) % n], ranks[(i - 1) % n]
    plan = segments(buffers, n, SEGMENT_BYTES if segment_bytes is None else segment_bytes)
    # Step t receives chunk recv[t] in phase[t] and, but for the last, sends it on at t + 1.
    recv = [(i - s - 1) % n for s in range(n - 1)] + [(i - s) % n for s in range(n - 1)]
    phase = ["reduce"] * (n - 1) + ["gather"] * (n - 1)
    sender = _Sender(lambda frame: send(nxt, frame), any(len(c) > 1 for c in plan),
                     interrupt, f"meshkit-ring-r{me}")

    def post(c: int, step: int, k: int, x: np.ndarray) -> None:
        sender.post(_segment(round_, check, c, phase[step], k, x))

    def receive(c: int, step: int, k: int) -> np.ndarray:
        while True:
            src, payload = take()
            r = payload.get("r")
            if isinstance(r, int) and not isinstance(r, bool) and r < round_:
                # A late segment of an earlier round (one that failed, or a step this
                # rank skipped): it belongs to no sum any more, so it is dropped, never
                # added into this round's.
                continue
            if r != round_ and src == prv:
                raise MeshError(
                    f"mesh_all_reduce round {round_}: rank {me} got a segment of round {r!r} "
                    f"from rank {src}: the participants disagree on the round (or step) "
                    f"this collective is")
            break
        if payload.get("check") != check and src == prv:
            raise AggregationError(
                f"mesh_all_reduce round {round_}: rank {src} contributes a different layout "
                f"(keys, shapes or dtypes) than rank {me}; every participant must reduce the "
                f"same keys with the same shapes and dtypes")
        if (src != prv or payload.get("c") != c or payload.get("phase") != phase[step]
                or payload.get("k") != k):
            raise MeshError(
                f"mesh_all_reduce round {round_}: rank {me} expected segment {k} of chunk {c} "
                f"({phase[step]}) from rank {prv}, got segment {payload.get('k')!r} of chunk "
                f"{payload.get('c')!r} ({payload.get('phase')!r}) from rank {src}: the "
                f"participants disagree on the ranks or the order of collectives")
        x = payload.get("x")
        if not isinstance(x, np.ndarray):
            # The frame's fields are checked above; its data must be an array too.
            raise ProtocolError(
                f"mesh_all_reduce round {round_}: rank {src} sent segment {k} of chunk {c} "
                f"without an array (x is {type(x).__name__}); a ring frame is "
                f"{{r, check, c, phase, k, x}} (docs/protocol.md §5.1)")
        return x

    scratch: dict[int, np.ndarray] = {}

    def spare(b: int, size: int) -> np.ndarray:
        # Where a scaled share is computed before it is added to a landed segment.
        have = scratch.get(b)
        if have is None or have.size < size:
            have = scratch[b] = np.empty(max(hi - lo for c in plan for bb, lo, hi in c
                                             if bb == b), buffers[b].dtype)
        return have[:size]

    remove = None
    if receive_into is not None:
        landing = _Landing()
        for step, c in enumerate(recv):
            if phase[step] == "reduce" and own is None:
                continue  # the buffers already hold this rank's share: nothing may land there
            for k, (b, lo, hi) in enumerate(plan[c]):
                target = buffers[b][lo:hi]
                if target.nbytes >= _LAND_MIN:
                    landing.expect(_segment(round_, check, c, phase[step], k, target), target)
        remove = receive_into(landing)
    try:
        for k, (b, lo, hi) in enumerate(plan[i]):
            mine = buffers[b][lo:hi]
            if own is not None:
                source = own(b, lo, hi, mine)
                if source is not None:
                    mine = source  # overwritten only by the all-gather, after it is sent
            post(i, 0, k, mine)
        last = len(recv) - 1
        for step, c in enumerate(recv):
            adding = phase[step] == "reduce"
            for k, (b, lo, hi) in enumerate(plan[c]):
                got = receive(c, step, k)
                target = buffers[b][lo:hi]
                if got.shape != target.shape or got.dtype != target.dtype:
                    raise AggregationError(
                        f"mesh_all_reduce round {round_}: rank {prv} sent {got.dtype}"
                        f"{list(got.shape)} for segment {k} of chunk {c}, rank {me} expected "
                        f"{target.dtype}{list(target.shape)}: the participants' layouts differ")
                landed = got.size > 0 and got.ctypes.data == target.ctypes.data
                if landed:
                    if adding:  # only with ``own``: add our share where the segment landed
                        assert own is not None
                        out = spare(b, hi - lo)
                        source = own(b, lo, hi, out)
                        combine(target, out if source is None else source, out=target)
                elif not adding:
                    target[...] = got
                elif own is not None:  # each chunk visits once in the reduce: add our share
                    source = own(b, lo, hi, target)
                    combine(target if source is None else source, got, out=target)
                else:
                    combine(target, got, out=target)
                del got  # the channel recycles the receive buffer once nothing holds it
                if step < last:
                    post(c, step + 1, k, target)
        sender.finish()
    except BaseException:
        sender.stop()
        raise
    finally:
        if remove is not None:
            remove()  # nothing more lands in these buffers


class Collective:
    """One group's mesh all-reduce: rounds per set of participants, the ring or the engine's sum."""

    def __init__(self, ledger: Ledger, mailboxes: Mailboxes,
                 send: Callable[[Message], None], links: Any, timeout: float,
                 is_star: bool) -> None:
        self._ledger = ledger
        self._mailboxes = mailboxes
        self._send = send
        self._links = links
        self._timeout = timeout
        self._is_star = is_star
        self._rounds: dict[tuple[int, ...], int] = {}
        self._lock = threading.Lock()
        # Buffers of earlier all-reduces, reused once nothing refers to them
        # (see _buffer): a fresh model-sized buffer is page-faulted in on its
        # first write, which cost as much as the copy into it.
        self._spare: list[np.ndarray] = []

    def all_reduce(self, state: Mapping[str, Any], weight: float,
                   ranks: Sequence[int] | None, timeout: float | None) -> dict[str, Any]:
        me = self._ledger.rank
        world = self._ledger.world_size
        members = tuple(sorted(set(range(world) if ranks is None else ranks)))
        if not members or any(isinstance(r, bool) or not isinstance(r, int)
                              or not 0 <= r < world for r in members):
            raise ValueError(f"ranks must be ranks in 0..{world - 1}, got {ranks!r}")
        if me not in members:
            raise ValueError(f"rank {me} called mesh_all_reduce over ranks {list(members)}, "
                             f"which do not include it")
        check_state(state)
        weight = _check_weight(weight, me)
        wait = self._timeout if timeout is None else float(timeout)
        with self._lock:
            round_ = self._rounds.get(members, 0) + 1
            self._rounds[members] = round_
        # The ring fills the buffers itself as it goes (no packing pass); only a
        # transport with a collective of its own needs them filled first.
        engine = getattr(self._links, "all_reduce_sum", None)
        own_engine = engine is not None and (
            getattr(type(self._links), "all_reduce_sum", None) is not Links.all_reduce_sum)
        ring = len(members) > 1 and not own_engine and not self._is_star
        layout, buffers = pack(state, weight, members, self._buffer, fill=not ring)
        if ring:
            self._ring(buffers, members, layout.check, round_, wait,
                       contribution(layout, state, weight))
        elif len(members) > 1:
            done = engine is not None and engine(buffers, list(members), layout.check, wait)
            if not done:
                if self._is_star:
                    raise MeshError(
                        "mesh_all_reduce needs direct links between the participants (a mesh, "
                        "or a transport with its own collective); in a star the round engine "
                        "folds on the coordinator (meshkit.train.fold_round)")
                self._ring(buffers, members, layout.check, round_, wait)
        return unpack(layout, buffers)

    def exact_sum(self, arrays: Mapping[str, np.ndarray], ranks: Sequence[int], step: int,
                  timeout: float | None, op: str = "sum") -> dict[str, np.ndarray]:
        """Every rank in ``ranks``: the elementwise sum (or ``op = "max"``: largest) of
        their ``arrays``, in the arrays' own dtype, over the ring.

        For exact sums of integer codes (DiLoCo's outer gradients): the caller picks
        the narrowest dtype that cannot overflow (an integer sum wraps silently) and
        numbers the call with ``step``, the same on every participant (a rank that
        healed mid-run has no count of earlier calls to agree on). A segment of an
        earlier step is dropped; the layout (keys, shapes, the one dtype, ``op``) must
        agree, or every participant gets an :class:`AggregationError`.
        """
        me = self._ledger.rank
        members = tuple(sorted(set(ranks)))
        if me not in members or any(not 0 <= r < self._ledger.world_size for r in members):
            raise ValueError(f"rank {me} called exact_sum over ranks {list(members)}")
        if op not in ("sum", "max"):
            raise ValueError(f"op must be 'sum' or 'max', got {op!r}")
        keys = sorted(arrays)
        dtypes = {np.asarray(arrays[k]).dtype for k in keys}
        if len(dtypes) > 1 or any(d.kind not in "iuf" for d in dtypes):
            raise AggregationError(
                f"exact_sum: the arrays must share one integer or floating dtype, got "
                f"{sorted(str(d) for d in dtypes)} (keys {keys[:5]})")
        dtype = dtypes.pop() if dtypes else np.dtype(np.int16)
        entries = [(k, tuple(np.shape(arrays[k])), dtype) for k in keys]
        check = layout_digest([*entries, (f"\0exact_sum:{op}", (), dtype)], members)
        # This rank's own copy, one flat buffer, summed in place.
        buffer = (np.concatenate([np.ravel(arrays[k]) for k in keys]).astype(dtype)
                  if keys else np.zeros(0, dtype))
        if len(members) > 1:
            if self._is_star:
                raise MeshError("exact_sum needs direct links between the participants (a "
                                "mesh); a star has none")
            wait = self._timeout if timeout is None else float(timeout)
            self._ring([buffer], members, check, int(step), wait, tag=TAG_RING_SUM, op=op)
        out: dict[str, np.ndarray] = {}
        at = 0
        for key, shape, _ in entries:
            size = math.prod(shape)
            out[key] = buffer[at:at + size].reshape(shape)
            at += size
        return out

    def _buffer(self, size: int, dtype: np.dtype) -> np.ndarray:
        """A buffer for :func:`pack`: a spare one nothing references any more, or a new one.

        The mean a rank got back is views of its buffers, so a buffer is only
        reused once every such view (and the ring's frames) is gone: numpy
        views keep their base alive, so its reference count says so exactly.
        The last :data:`_SPARE_KEEP` buffers are kept (a training loop that
        replaces its state by the mean alternates between two).
        """
        with self._lock:
            for buffer in self._spare:
                # References: the list's slot, ``buffer`` and getrefcount's argument.
                if (buffer.size == size and buffer.dtype == dtype
                        and sys.getrefcount(buffer) <= 3):
                    return buffer
            buffer = np.empty(size, dtype)
            if size * buffer.itemsize >= _SPARE_MIN:
                self._spare.append(buffer)
                del self._spare[:-_SPARE_KEEP]
            return buffer

    def _ring(self, buffers: list[np.ndarray], members: tuple[int, ...], check: int,
              round_: int, wait: float, own: Own | None = None, *, tag: int = TAG_RING,
              op: str = "sum") -> None:
        me = self._ledger.rank
        others = frozenset(members) - {me}
        # Only the previous rank's chunks are needed; a rank further round
        # the ring may finish and leave first. A loss elsewhere reaches us as
        # the abort of the rank that waited on it.
        previous = members[(members.index(me) - 1) % len(members)]
        prv = frozenset({previous})

        def send(dst: int, payload: Mapping[str, Any]) -> None:
            self._send(Message(me, dst, tag, payload))

        def interrupt(exc: BaseException) -> None:
            # The ring's sender thread failed: wake the ring's receive with an
            # abort of its own (a send error is a lost link, as inline).
            kind = "aggregation" if isinstance(exc, AggregationError) else "lost"
            self._mailboxes.put(Message(me, me, tag, {
                "r": round_, "abort": f"sending failed: {exc}", "kind": kind}))

        sources = set(others) | {me}

        def take() -> tuple[int, Mapping[str, Any]]:
            while True:
                message = self._mailboxes.take(
                    tag, sources, wait, f"mesh_all_reduce round {round_}",
                    watch=prv)
                payload = message.payload
                if not isinstance(payload.get("r"), int) or payload["r"] < round_:
                    continue  # a chunk of an all-reduce that failed earlier
                if "abort" in payload:
                    error = AggregationError if payload.get("kind") == "aggregation" \
                        else PeerLostError
                    raise error(f"mesh_all_reduce round {round_}: rank {message.src} gave "
                                f"up: {payload['abort']}")
                return message.src, payload

        def receive_into(placer: _Landing) -> Callable[[], None] | None:
            return self._links.receive_into(previous, tag, placer)

        try:
            ring_sum(buffers, list(members), me, check, round_, send, take,
                     interrupt=interrupt, own=own, receive_into=receive_into, op=op)
        except (MeshError, OSError) as exc:
            kind = "aggregation" if isinstance(exc, AggregationError) else "lost"
            for rank in sorted(others):
                if self._ledger.reason(rank) is not None:
                    continue
                try:  # every participant must stop waiting, not only the next one
                    self._send(Message(me, rank, tag, {
                        "r": round_, "abort": str(exc), "kind": kind}))
                except (MeshError, OSError):
                    pass
            if isinstance(exc, OSError):
                raise PeerLostError(f"mesh_all_reduce round {round_}: {exc}") from exc
            raise


def _check_weight(weight: Any, rank: int) -> float:
    try:
        value = float(weight)
    except (TypeError, ValueError):
        raise AggregationError(f"mesh_all_reduce on rank {rank}: the weight must be a number "
                               f"(the realized work), got {weight!r}") from None
    if isinstance(weight, bool) or not math.isfinite(value) or value < 0:
        raise AggregationError(f"mesh_all_reduce on rank {rank}: the weight must be finite "
                               f"and >= 0 (the realized work), got {weight!r}")
    return value
