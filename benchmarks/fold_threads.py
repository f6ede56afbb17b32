"""The fold against ``np.sum`` and against the code before, in one process, with the traffic's ceiling.

Run (from the repository root, in the dev venv)::

    git worktree add --detach /tmp/base BASE     # the code before
    python benchmarks/fold_threads.py --baseline /tmp/base
    python benchmarks/fold_threads.py --baseline /tmp/base --params 1e5 1e6 1e7

Loads the baseline's ``meshkit/aggregation/_threads.py`` and ``_mean.py``
beside this tree's in the same process and takes turns, trial by trial, on
the same inputs (``--contributors`` float32 contributions of ``--params``
parameters in ten arrays, unequal weights): ``np.sum`` over the inputs (the
read bandwidth issue 36 measures against), the baseline's and this tree's
default streaming fold (``retain = 1``) on one and on two threads, and, for
the ceiling, bare numpy loops that move only the bytes the fold must move.

The ceiling. ``np.sum`` reads each input once: ``C x 4N`` bytes for C
contributions of N float32. The fold (``retain = 1``, contributions summed
in pairs) reads the same inputs, writes its fresh accumulator on the first
pair (which the kernel zeroes first: another ``4N``), and reads and writes
it once per later pair: ``C x 4N + 2 x 4N + (C/2 - 1) x 8N`` bytes, 800 MB
against 400 MB at the default 10 x 10M. The rows "pair traffic" fold only
that: per 64Ki-element chunk ``t = x + y`` then ``acc += t`` (no weights,
no finiteness check), the fewest numpy passes that move the fold's bytes in
its grouping, on one thread and on this tree's fold threads. The fold
cannot beat them; "of ceiling" says how close it is (for two threads,
against the faster of the two rows: a small fold stays on one thread). "a += x" (one thread,
whole arrays, three streams) shows what one core's streaming add moves.

Checks that every fold gives the same bits. Prints each row's median
(min-max) ms, its ratio to ``np.sum`` (> 1: faster), bytes moved and
GB/s, the per-trial ratio baseline / this on two threads (> 1: this
faster), and the load average before and after. This is a measurement, not
a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshkit.aggregation import CHUNK_ELEMENTS, MeanFold
from meshkit.aggregation._threads import run_tasks, tasks


def _load(name: str, path: Path, replace: dict[str, str] | None = None) -> Any:
    source = path.read_text()
    for old, new in (replace or {}).items():
        source = source.replace(old, new)
    module = type(sys)(name)
    module.__file__ = str(path)
    sys.modules[name] = module
    exec(compile(source, str(path), "exec"), module.__dict__)  # noqa: S102 (the baseline's code)
    return module


def pair_traffic(states: list[dict[str, np.ndarray]], threads: int) -> np.ndarray:
    """acc = sum over pairs of (x + y), in 64Ki-element chunks: only the fold's bytes."""
    keys = list(states[0])
    sizes = [states[0][k].size for k in keys]
    acc = np.empty(sum(sizes), dtype=np.float32)
    accs, offset = [], 0
    for size in sizes:
        accs.append(acc[offset:offset + size])
        offset += size
    step = CHUNK_ELEMENTS
    scratch = [np.empty(step, dtype=np.float32) for _ in range(threads)]
    work = tasks(sizes, step)
    for pair in range(len(states) // 2):
        first, second = states[2 * pair], states[2 * pair + 1]

        def run(worker: int, task: tuple[int, int, int], pair: int = pair,
                first: dict[str, np.ndarray] = first,
                second: dict[str, np.ndarray] = second) -> list[Any]:
            index, lo, hi = task
            a_all, x, y = accs[index], first[keys[index]], second[keys[index]]
            t = scratch[worker]
            for start in range(lo, hi, step):
                stop = min(start + step, hi)
                a = a_all[start:stop]
                if pair == 0:
                    np.add(x[start:stop], y[start:stop], out=a)
                else:
                    s = t[:stop - start]
                    np.add(x[start:stop], y[start:stop], out=s)
                    np.add(a, s, out=a)
            return []

        run_tasks(run, work, threads)
    return acc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, type=Path, help="a checkout of the code before")
    parser.add_argument("--params", type=float, nargs="+", default=[10e6])
    parser.add_argument("--contributors", type=int, default=10)
    parser.add_argument("--trials", type=int, default=9)
    args = parser.parse_args(argv)
    if args.contributors < 2 or args.contributors % 2:
        parser.error("--contributors must be even (the ceiling rows fold pairs)")
    _load("baseline_threads", args.baseline / "meshkit" / "aggregation" / "_threads.py")
    baseline = _load("baseline_mean", args.baseline / "meshkit" / "aggregation" / "_mean.py",
                     {"from meshkit.aggregation._threads import":
                      "from baseline_threads import"}).MeanFold
    for params in args.params:
        measure(baseline, int(params), args.contributors, args.trials)
    return 0


def measure(baseline: Any, params: int, contributors: int, trials: int) -> None:
    rng = np.random.default_rng(0)
    states = [{f"a{j}": rng.standard_normal(params // 10, dtype=np.float32) for j in range(10)}
              for _ in range(contributors)]
    weights = [100.0 + i for i in range(contributors)]
    model = 4 * sum(v.size for v in states[0].values())

    def fold(cls: Any, threads: int) -> dict[str, Any]:
        folding = cls(weighted=True, threads=threads)
        for state, weight in zip(states, weights):
            folding.add(state, weight)
        return folding.result()

    def read() -> None:
        for state in states:
            for value in state.values():
                np.sum(value)

    def read2() -> None:
        values = [v for state in states for v in state.values()]
        other = threading.Thread(target=lambda: [np.sum(v) for v in values[1::2]])
        other.start()
        for value in values[::2]:
            np.sum(value)
        other.join()

    def stream() -> list[np.ndarray]:
        accs = [value.copy() for value in states[0].values()]
        for state in states[1:]:  # the whole model per contribution: acc stays in memory
            for acc, value in zip(accs, state.values()):
                np.add(acc, value, out=acc)
        return accs

    old = fold(baseline, 2)
    for cls, threads in ((baseline, 1), (MeanFold, 1), (MeanFold, 2)):
        new = fold(cls, threads)
        assert all(old[k].tobytes() == new[k].tobytes() for k in old), "the bits differ"
    fold_bytes = contributors * model + 2 * model + (contributors // 2 - 1) * 2 * model
    # a += x: the copy (2 x the model), then 3 x per add.
    rows: dict[str, tuple[Callable[[], Any], int]] = {
        "np.sum over the inputs": (read, contributors * model),
        "np.sum, 2 threads (reference)": (read2, contributors * model),
        "a += x, whole arrays, 1 thread": (stream, 2 * model + 3 * model * (contributors - 1)),
        "pair traffic, 1 thread (ceiling)": (lambda: pair_traffic(states, 1), fold_bytes),
        "pair traffic, 2 threads (ceiling)": (lambda: pair_traffic(states, 2), fold_bytes),
        "fold, 1 thread (baseline)": (lambda: fold(baseline, 1), fold_bytes),
        "fold, 1 thread (this)": (lambda: fold(MeanFold, 1), fold_bytes),
        "fold, 2 threads (baseline)": (lambda: fold(baseline, 2), fold_bytes),
        "fold, 2 threads (this)": (lambda: fold(MeanFold, 2), fold_bytes),
    }
    times: dict[str, list[float]] = {label: [] for label in rows}
    print(f"# {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; "
          f"{contributors} x {params:,} float32; {trials} trials, rows taking turns; the "
          f"fold moves {fold_bytes / 1e6:.0f} MB where np.sum reads "
          f"{contributors * model / 1e6:.0f} MB")
    for _ in range(trials):
        for label, (fn, _) in rows.items():
            start = time.perf_counter()
            out = fn()
            times[label].append(time.perf_counter() - start)
            del out
    base = statistics.median(times["np.sum over the inputs"])
    ceilings = {threads: statistics.median(times[f"pair traffic, {threads} thread"
                                                 f"{'s' if threads > 1 else ''} (ceiling)"])
                for threads in (1, 2)}
    for label, values in times.items():
        median = statistics.median(values)
        moved = rows[label][1]
        extra = ""
        if label.startswith("fold"):
            # Two threads may use one (a small fold does): the better ceiling is theirs.
            best = ceilings[1] if "1 thread" in label else min(ceilings.values())
            extra = f"  of ceiling {best / median:.2f}"
        print(f"{label:<36} {median * 1e3:8.2f} ms ({min(values) * 1e3:.2f}-"
              f"{max(values) * 1e3:.2f})  x np.sum {base / median:.2f}  "
              f"{moved / 1e6:5.0f} MB {moved / median / 1e9:5.1f} GB/s{extra}")
    pairs = [b / t for b, t in zip(times["fold, 2 threads (baseline)"],
                                   times["fold, 2 threads (this)"])]
    print(f"per-trial baseline / this, 2 threads: median {statistics.median(pairs):.2f} "
          f"({min(pairs):.2f}-{max(pairs):.2f})")
    print(f"# load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    sys.exit(main())
