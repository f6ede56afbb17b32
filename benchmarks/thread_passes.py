"""Whether two threads running numpy's cache-sized passes run in parallel here: against two processes.

Run (from the repository root, in the dev venv)::

    python benchmarks/thread_passes.py
    python benchmarks/thread_passes.py --elements 65536 262144 --reps 4000

Why. The fold (``MeanFold``, :mod:`meshkit.aggregation._threads`) splits a
large fold across threads, each making numpy passes over 64Ki-element
chunks that fit in L2. numpy releases the GIL inside each pass, but every
pass hands the GIL back: when waking a thread parked on the other core
costs about as much as a pass, two threads gain nothing. This measures it
with nothing shared but the interpreter: each worker loops over its own
arrays doing the fold's passes a chunk (two scaling ``multiply``, an
``add``, the check's ``dot``), alone, as two threads, and as two processes
(the baseline: no GIL between them). Prints per size the time of one
iteration alone and the speed-up of two threads and of two processes over
one (2.0 is perfect), and the load average. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import threading
import time
from typing import Any

import numpy as np


def passes(elements: int, reps: int) -> float:
    """``reps`` iterations of the fold's four passes on private arrays; seconds taken."""
    x = np.random.default_rng(0).standard_normal(elements, dtype=np.float32)
    t, u = np.empty_like(x), np.empty_like(x)
    np.multiply(x, 1.01, out=t)  # fault the pages in before the clock
    np.multiply(x, 1.02, out=u)
    start = time.perf_counter()
    for _ in range(reps):
        np.multiply(x, 1.01, out=t)
        np.multiply(x, 1.02, out=u)
        np.add(t, u, out=t)
        np.dot(t, t)
    return time.perf_counter() - start


def _together(start: Any, elements: int, reps: int) -> None:
    start.wait()
    passes(elements, reps)


def two(kind: str, elements: int, reps: int) -> float:
    """Wall time of two workers, each doing ``reps`` iterations, started together."""
    if kind == "threads":
        barrier: Any = threading.Barrier(3)
        workers = [threading.Thread(target=_together, args=(barrier, elements, reps))
                   for _ in range(2)]
    else:
        barrier = multiprocessing.get_context("fork").Barrier(3)
        workers = [multiprocessing.get_context("fork").Process(
            target=_together, args=(barrier, elements, reps)) for _ in range(2)]
    for worker in workers:
        worker.start()
    barrier.wait()
    start = time.perf_counter()
    for worker in workers:
        worker.join()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=int, nargs="+",
                        default=[65536, 131072, 262144, 524288])
    parser.add_argument("--reps", type=int, default=3000, help="iterations at 64Ki (scaled)")
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"# {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; best of "
          f"{args.trials} trials; speed-up = 2 x one worker's time / two workers' time")
    for elements in args.elements:
        reps = max(10, args.reps * 65536 // elements)
        one = min(passes(elements, reps) for _ in range(args.trials))
        threads = min(two("threads", elements, reps) for _ in range(args.trials))
        processes = min(two("processes", elements, reps) for _ in range(args.trials))
        print(f"{elements:>9,} elements: one iteration {one / reps * 1e6:7.1f} us; "
              f"2 threads x{2 * one / threads:.2f}, 2 processes x{2 * one / processes:.2f}")
    print(f"# load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
