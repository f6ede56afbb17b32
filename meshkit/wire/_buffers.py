"""The process-wide buffers frames are received into and encrypted through.

Every channel in a process shares them: a coordinator has one channel per
worker, and buffers per channel made its memory grow with the number of
workers. Two pools, each with its rule: a receive buffer is recycled only
once nothing refers to it any more (:func:`_receive_buffer`), and a send
scratch buffer is lent for one frame and given back (:func:`_take_scratch`,
:func:`_give_scratch`). ``_channel`` decides what goes into them.
"""

from __future__ import annotations

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
# and gives it back; at most _SCRATCH_KEEP are kept between frames.
_SCRATCH_KEEP = 4
_scratch_free: list[bytearray] = []
_scratch_lock = threading.Lock()
# A segmented message's body up to _MESSAGE_MAX bytes (a pulled contribution's
# piece: 32 MiB by default) goes into the one recycled message buffer when
# nothing refers to it any more. A fresh body that size is a fresh mmap: the
# kernel zeroes every page as the receive first touches it and unmaps it when
# the piece is dropped, and that zeroing was most of the CPU a large transfer
# took (docs/benchmarks.md, issue 39). One slot, so a process holds at most
# _MESSAGE_MAX bytes of idle message buffer; bigger bodies (a whole model's
# state) are allocated as before.
_MESSAGE_MAX = 64 << 20
_message_slot: list[np.ndarray] = []


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
        return np.empty(size, dtype=np.uint8)
    with _recv_pool_lock:
        if _message_slot:
            buf = _message_slot[0]
            # References: the slot, ``buf`` and getrefcount's argument.
            if buf.nbytes >= size and sys.getrefcount(buf) <= 3:
                return buf[:size]
        buf = np.empty(size, dtype=np.uint8)
        _message_slot[:] = [buf]
        return buf


def _take_scratch() -> bytearray:
    with _scratch_lock:
        if _scratch_free:
            return _scratch_free.pop()
    return bytearray(_SEND_PIECE)


def _give_scratch(buffer: bytearray) -> None:
    with _scratch_lock:
        if len(_scratch_free) < _SCRATCH_KEEP:
            _scratch_free.append(buffer)
