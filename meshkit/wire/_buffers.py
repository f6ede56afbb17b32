"""The process-wide buffers frames are received into and encrypted through.

Every channel in a process shares them: a coordinator has one channel per
worker, and buffers per channel made its memory grow with the number of
workers. Two pools, each with its rule: a receive buffer is recycled only
once nothing refers to it any more (:func:`_receive_buffer`), and a send
scratch buffer is lent for one frame and given back (:func:`_take_scratch`,
:func:`_give_scratch`). A small frame is built (and sealed) in, and a small
encrypted body read into before it is opened, a buffer its thread keeps
(:func:`_thread_buffer`).
``_channel`` decides what goes into them.
"""

from __future__ import annotations

import mmap
import sys
import threading

import numpy as np

#: Size of one scratch piece: a big body is encrypted (and sent) this much at a time.
_SEND_PIECE = 1 << 20
# Receive buffers between these sizes are recycled once nothing refers to them
# (see _receive_buffer). The pool is shared by every channel in the process,
# like the scratch buffers below: a coordinator has one channel per worker,
# and a pool each made its memory grow by up to _POOL_SIZE frames per worker.
# At most _POOL_SIZE are kept, so the process holds at most 16 MiB of idle
# receive buffers. Above 4 MiB the transfer dominates and numpy backs the
# allocation with huge pages anyway.
_POOL_MIN = 64 * 1024
_POOL_MAX = 4 << 20
_POOL_SIZE = 4
_recv_pool: list[np.ndarray] = []
_recv_pool_lock = threading.Lock()
# Big bodies are encrypted piece by piece into a scratch buffer of
# _SEND_PIECE bytes. The buffers are shared by every channel in the process:
# a coordinator has one channel per worker, and a scratch each would make
# its memory grow by _SEND_PIECE per worker. A sender takes one for the frame
# and gives it back; at most _SCRATCH_KEEP are kept between frames: one, as a
# sender writing its links one after another needs; links written at once
# (the round's state, a writer thread per link) each take a fresh one for the
# frame. A scratch is an anonymous mapping, not a malloc'd bytearray: one freed
# by a writer thread stayed in that thread's malloc arena (glibc keeps freed
# memory of a size it has seen freed before), so the coordinator's resident
# memory kept every concurrent writer's scratch (issue 36's 10M x 8 bound,
# docs/benchmarks.md); a mapping goes back to the kernel when dropped.
_SCRATCH_KEEP = 1
_scratch_free: list[mmap.mmap] = []
_scratch_lock = threading.Lock()
# A segmented message's body up to _MESSAGE_MAX bytes (a pulled contribution's
# piece: 32 MiB by default) goes into the one recycled message buffer when
# nothing refers to it any more. A fresh body that size is a fresh mmap: the
# kernel zeroes every page as the receive first touches it and unmaps it when
# the piece is dropped, and that zeroing was most of the CPU a large transfer
# took (docs/benchmarks.md, issue 39). _MESSAGE_SLOTS slots: a coordinator
# pulls up to two pieces ahead of its fold (meshkit.train's piece round), so a
# piece is folded while the next is queued and the one after it is read, and
# a single slot sent every other piece to a fresh mapping. A process holds at
# most _MESSAGE_SLOTS * _MESSAGE_MAX bytes of idle message buffers.
_MESSAGE_MAX = 64 << 20
_MESSAGE_SLOTS = 3
_message_slots: list[np.ndarray] = []
# Bodies above _MESSAGE_MAX (a whole model's state, received by a worker each
# round) are recycled only in a process that asked for it (recycle_large_messages):
# a worker holds the model it was sent until the next one has arrived, so two
# buffers take turns, and from the third message on none is a fresh mapping.
# Off by default: a coordinator's memory bound (two models) has no room for an
# idle model-sized buffer.
_large_keep = 0
# A recycled buffer is allocated to the next multiple of this (see _recycled).
_SLACK = 1 << 20
_large_slots: list[np.ndarray] = []
# A small frame is laid out (header, body or ciphertext, tag) and sent from a
# buffer its thread keeps, and a small encrypted body is read into it and
# opened from there into the frame's own buffer. Without it each frame was
# one fresh allocation and one copy more on either side (``header + sealed``;
# ``decrypt_into`` may not read and write the same bytes). Per thread, not per
# channel: a thread builds or opens one frame at a time and nothing it calls
# in between uses the buffer. At most _THREAD_KEEP bytes a thread; a bigger
# frame gets a fresh buffer.
_THREAD_KEEP = 64 * 1024
_THREAD_STEP = 16 * 1024
_per_thread = threading.local()


def _receive_buffer(size: int) -> np.ndarray:
    """A buffer for one frame: a recycled one nothing references any more, or a new one.

    Reading into memory that was just used keeps a steady stream of frames
    in cache (a fresh allocation is cold, and often page-faulted in). A
    buffer is only recycled once no decoded array, frame or view refers to
    it: numpy views keep their base alive, so the reference count says so
    exactly. The check runs under the pool's lock and the taker holds its
    reference from then on, so two readers never get the same buffer.
    """
    if not _POOL_MIN <= size <= _POOL_MAX:
        return np.empty(size, dtype=np.uint8)
    with _recv_pool_lock:
        for buf in _recv_pool:
            # References: the pool's slot, ``buf`` and getrefcount's argument.
            if buf.nbytes == size and sys.getrefcount(buf) <= 3:
                return buf
        buf = np.empty(size, dtype=np.uint8)
        if len(_recv_pool) >= _POOL_SIZE:
            _recv_pool.pop(0)
        _recv_pool.append(buf)
        return buf


def _message_buffer(size: int) -> np.ndarray:
    """A buffer of exactly ``size`` bytes for a segmented message's body (see _MESSAGE_MAX).

    A view of the recycled buffer when nothing else refers to it and it is
    big enough, else a new buffer (which becomes the recycled one when it
    fits the slot). As with :func:`_receive_buffer`, the reference count
    (checked under the pool's lock) says exactly whether a decoded array,
    frame or view still uses the buffer: numpy views keep their base alive.
    """
    if size > _MESSAGE_MAX:
        return _recycled(size, _large_slots, _large_keep)
    return _recycled(size, _message_slots, _MESSAGE_SLOTS)


def _recycled(size: int, slots: list[np.ndarray], keep: int) -> np.ndarray:
    """A view of ``size`` bytes of a slot nothing refers to, else a new buffer (kept in a
    free place among ``keep`` slots; a slot still in use is never replaced)."""
    if keep <= 0:
        return np.empty(size, dtype=np.uint8)
    with _recv_pool_lock:
        # By index, so that no loop variable holds a slot while its references are
        # counted: the list's and getrefcount's argument are the only ones of an idle slot.
        for i in range(len(slots)):
            if slots[i].nbytes >= size and sys.getrefcount(slots[i]) <= 2:
                return slots[i][:size]
        # Rounded up: the next message of the same model is often a few bytes longer
        # (its request's sequence number, a piece's header), and must still fit.
        fresh = np.empty(-(-size // _SLACK) * _SLACK, dtype=np.uint8)
        for i in range(len(slots)):
            if sys.getrefcount(slots[i]) <= 2:  # idle, but too small: the new one replaces it
                slots[i] = fresh
                return fresh[:size]
        if len(slots) < keep:
            slots.append(fresh)
        return fresh[:size]


def recycle_large_messages(count: int) -> None:
    """Keep up to ``count`` received message bodies above 64 MiB for reuse (0: none).

    For a process that receives a whole model each round and holds it until
    the next one has arrived (a worker: ``count`` 2): its bodies are then read
    into memory the kernel does not zero again. A kept body is reused only
    once nothing refers to it (as the smaller ones, :func:`_message_buffer`);
    an idle one costs its size in memory, so a process that must stay within
    a memory bound (a coordinator) leaves this off.
    """
    global _large_keep
    if not 0 <= count <= 4:
        raise ValueError(f"recycle_large_messages keeps 0 to 4 bodies, got {count}")
    with _recv_pool_lock:
        _large_keep = count
        del _large_slots[count:]


def _thread_buffer(size: int) -> memoryview:
    """``size`` writable bytes for one small frame, in the calling thread's kept buffer
    (see _THREAD_KEEP): the caller is done with them before it returns."""
    buf = getattr(_per_thread, "buffer", None)
    if buf is None or len(buf) < size:
        if size > _THREAD_KEEP:
            return memoryview(bytearray(size))
        buf = _per_thread.buffer = memoryview(bytearray(-(-size // _THREAD_STEP) * _THREAD_STEP))
    return buf[:size]


def _take_scratch() -> mmap.mmap:
    with _scratch_lock:
        if _scratch_free:
            return _scratch_free.pop()
    return mmap.mmap(-1, _SEND_PIECE)


def _give_scratch(buffer: mmap.mmap) -> None:
    with _scratch_lock:
        if len(_scratch_free) < _SCRATCH_KEEP:
            _scratch_free.append(buffer)
