"""How a large fold is split across threads: contiguous shares, the same bits as one thread.

A fold's float elements (all arrays, in order) are cut into one contiguous
share per thread, on chunk boundaries, so each thread streams through its
own memory; the arithmetic of every element is the same whoever folds it,
so the result is bit for bit the one-thread result. The calling thread folds
the first share, the process's fold pool the others.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Sequence, TypeVar

#: Threads a large fold uses by default. Two cores bring a fold to memory
#: bandwidth (its cache-resident passes are what one core is short of;
#: docs/benchmarks/aggregate.md), and a coordinator's other threads need the
#: rest of the machine for the network.
DEFAULT_THREADS = 2

# Folds smaller than this (float elements over all arrays) stay on the
# calling thread: handing work to another thread costs more than it saves.
_THREADED_MIN_ELEMENTS = 1 << 20

_T = TypeVar("_T")

_pool: tuple[int, ThreadPoolExecutor] | None = None
_pool_lock = threading.Lock()


def _fold_pool() -> ThreadPoolExecutor:
    """The process's fold threads (made on first use, and again in a forked child)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(thread_name_prefix="meshkit-fold"))
        return _pool[1]


def workers_for(total: int, threads: int, *, init: bool) -> int:
    """How many threads fold ``total`` float elements (at most ``threads``)."""
    # The first fold writes fresh memory: two threads faulting its pages
    # in at once were 6x slower than one here, so it stays on one thread.
    return threads if total >= _THREADED_MIN_ELEMENTS and not init else 1


def split(sizes: Sequence[int], workers: int, chunk: int) -> list[list[tuple[int, int, int]]]:
    """Each worker's share as ``(array index, lo, hi)`` ranges, cut on chunk boundaries."""
    total = sum(sizes)
    share = -(-total // workers)
    share = -(-share // chunk) * chunk
    shares: list[list[tuple[int, int, int]]] = [[] for _ in range(workers)]
    offset = 0
    for index, size in enumerate(sizes):
        lo = 0
        while lo < size:
            worker = min((offset + lo) // share, workers - 1)
            hi = min(size, (worker + 1) * share - offset)
            if worker == workers - 1:
                hi = size
            shares[worker].append((index, lo, hi))
            lo = hi
        offset += size
    return shares


def run_shares(run: Callable[[int], list[_T]], workers: int) -> list[_T]:
    """``run(0)`` here and ``run(1 .. workers-1)`` on the fold pool; all their items."""
    if workers == 1:
        return run(0)
    futures = [_fold_pool().submit(run, worker) for worker in range(1, workers)]
    try:
        found = run(0)
    finally:
        # Every share is done (or failed) before anything is reported:
        # no thread may still write the accumulators after we return.
        wait(futures)
    for future in futures:
        found.extend(future.result())
    return found
