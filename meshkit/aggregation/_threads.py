"""How a large fold is split across threads: tasks taken as threads come free, the same bits as one thread.

A fold's float elements (all arrays, in order) are cut into contiguous
tasks of about :data:`TASK_ELEMENTS` on chunk boundaries, so each thread
streams through memory a task at a time; the arithmetic of every element is
the same whoever folds it, so the result is bit for bit the one-thread
result. The calling thread and the process's fold pool take the next task
not taken yet until none is left: a thread that is not scheduled (a busy
machine) leaves its tasks to the others instead of holding the fold up,
as fixed halves did (the calling thread waiting on the other's half made
a two-thread fold slower than one on a loaded machine, docs/benchmarks.md).
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

#: Elements of one task (4 MiB of float32): large enough that taking one costs
#: nothing next to folding it, small enough that a thread left unscheduled holds up
#: at most one task's worth of the fold.
TASK_ELEMENTS = 1 << 20

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


def tasks(sizes: Sequence[int], chunk: int,
          elements: int | None = None) -> list[tuple[int, int, int]]:
    """The fold's tasks, in order: ``(array index, lo, hi)`` ranges of about ``elements``
    (default :data:`TASK_ELEMENTS`), cut on chunk boundaries."""
    step = max(chunk, (TASK_ELEMENTS if elements is None else elements) // chunk * chunk)
    return [(index, lo, min(size, lo + step))
            for index, size in enumerate(sizes) for lo in range(0, size, step)]


def run_tasks(run: Callable[[int, tuple[int, int, int]], list[_T]],
              work: Sequence[tuple[int, int, int]], workers: int) -> list[_T]:
    """``run(worker, task)`` for every task, on the calling thread (worker 0) and ``workers
    - 1`` fold pool threads, each taking the next task not taken yet; all their items."""
    if workers == 1:
        return [item for task in work for item in run(0, task)]
    queue = iter(work)
    lock = threading.Lock()

    def take(worker: int) -> list[_T]:
        found: list[_T] = []
        while True:
            with lock:
                task = next(queue, None)
            if task is None:
                return found
            found.extend(run(worker, task))

    futures = [_fold_pool().submit(take, worker) for worker in range(1, workers)]
    try:
        found = take(0)
    finally:
        # Every task is done (or failed) before anything is reported:
        # no thread may still write the accumulators after we return.
        wait(futures)
    for future in futures:
        found.extend(future.result())
    return found
