"""The threaded fold: tasks taken as threads come free against the code before's fixed halves, in one process.

Run (from the repository root, in the dev venv)::

    git worktree add --detach /tmp/base BASE     # the code before (fixed halves)
    python benchmarks/fold_threads.py --baseline /tmp/base

Loads the baseline's ``meshkit/aggregation/_threads.py`` and ``_mean.py``
beside this tree's in the same process and takes turns, trial by trial, on
the same inputs (``--contributors`` float32 contributions of ``--params``
parameters in ten arrays, unequal weights): ``np.sum`` over the inputs (the
read bandwidth the issue measures against), this tree's fold on one thread,
the baseline's fold on two threads (fixed halves) and this tree's on two
(tasks). Checks that both two-thread folds give the same bits. Prints each
row's median (min-max) ms, its ratio to ``np.sum`` (> 1: faster), the
per-trial ratio halves / tasks (> 1: tasks faster), and the load.

This is a measurement, not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshkit.aggregation import MeanFold  # noqa: E402


def _load(name: str, path: Path, replace: dict[str, str] | None = None) -> Any:
    source = path.read_text()
    for old, new in (replace or {}).items():
        source = source.replace(old, new)
    module = type(sys)(name)
    module.__file__ = str(path)
    sys.modules[name] = module
    exec(compile(source, str(path), "exec"), module.__dict__)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, type=Path, help="a checkout of the code before")
    parser.add_argument("--params", type=float, default=10e6)
    parser.add_argument("--contributors", type=int, default=10)
    parser.add_argument("--trials", type=int, default=9)
    args = parser.parse_args(argv)
    _load("baseline_threads", args.baseline / "meshkit" / "aggregation" / "_threads.py")
    baseline = _load("baseline_mean", args.baseline / "meshkit" / "aggregation" / "_mean.py",
                     {"from meshkit.aggregation._threads import":
                      "from baseline_threads import"}).MeanFold
    rng = np.random.default_rng(0)
    params = int(args.params)
    states = [{f"a{j}": rng.standard_normal(params // 10, dtype=np.float32) for j in range(10)}
              for _ in range(args.contributors)]
    weights = [100.0 + i for i in range(args.contributors)]

    def fold(cls: Any, threads: int) -> dict[str, Any]:
        folding = cls(weighted=True, threads=threads)
        for state, weight in zip(states, weights):
            folding.add(state, weight)
        return folding.result()

    def read() -> None:
        for state in states:
            for value in state.values():
                np.sum(value)

    old, new = fold(baseline, 2), fold(MeanFold, 2)
    assert all(old[k].tobytes() == new[k].tobytes() for k in old), "the bits differ"
    rows: dict[str, Callable[[], Any]] = {
        "np.sum over the inputs": read,
        "fold, 1 thread (this)": lambda: fold(MeanFold, 1),
        "fold, 2 threads, halves (baseline)": lambda: fold(baseline, 2),
        "fold, 2 threads, tasks (this)": lambda: fold(MeanFold, 2),
    }
    times: dict[str, list[float]] = {label: [] for label in rows}
    print(f"# {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; "
          f"{args.contributors} x {params:,} float32; {args.trials} trials, rows taking turns")
    for _ in range(args.trials):
        for label, fn in rows.items():
            start = time.perf_counter()
            out = fn()
            times[label].append(time.perf_counter() - start)
            del out
    base = statistics.median(times["np.sum over the inputs"])
    for label, values in times.items():
        median = statistics.median(values)
        print(f"{label:<38} {median * 1e3:9.1f} ms ({min(values) * 1e3:.1f}-"
              f"{max(values) * 1e3:.1f})  x np.sum {base / median:.2f}")
    pairs = [h / t for h, t in zip(times["fold, 2 threads, halves (baseline)"],
                                   times["fold, 2 threads, tasks (this)"])]
    print(f"per-trial halves / tasks: median {statistics.median(pairs):.2f} "
          f"({min(pairs):.2f}-{max(pairs):.2f})")
    print(f"# load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
