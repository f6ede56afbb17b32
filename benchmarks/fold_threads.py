"""The fold against ``np.sum`` and against the code before, in one process, with the traffic's ceiling.

Run (from the repository root, in the dev venv)::

    git worktree add --detach /tmp/base BASE     # the code before
    python benchmarks/fold_threads.py --baseline /tmp/base
    python benchmarks/fold_threads.py --baseline /tmp/base --params 1e5 1e6 1e7

Loads the baseline's ``meshkit/aggregation/_threads.py``, ``_arenas.py`` and
``_mean.py`` beside this tree's in the same process and takes turns, trial by trial, on
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
its grouping, on one thread and on this tree's fold threads. numpy's passes
cannot beat them; the fold's C kernel (one pass a chunk, issue 36) can, so
"of ceiling" above 1 means the kernel ran; it says how close the fold is (for two threads,
against the faster of the two rows: a small fold stays on one thread). "a += x" (one thread,
whole arrays, three streams) shows what one core's streaming add moves.

``--fused`` adds two rows that are **not meshkit's fold**: the same pairs
summed by a fused kernel, OpenBLAS's ``sgemv`` from numpy's own wheel
called through ctypes (``acc = f0*x0 + f1*x1 + acc`` in one pass a chunk,
the two inputs as the columns of a matrix whose leading dimension is their
address distance), with the same finiteness check, on one and two threads
(OpenBLAS's own pool set to one thread for them). They show what a fused
multiply-add would buy: numpy has none, so the fold makes two passes per
weighted input. Their bits are not the fold's (a fused multiply-add rounds
once, and whether a kernel fuses depends on the CPU), so they are checked
against the fold to float32 precision, not bit for bit.

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


class FusedPairs:
    """The pairs' weighted sum by OpenBLAS ``sgemv`` (``--fused``): not meshkit's fold."""

    def __init__(self) -> None:
        import ctypes

        from meshkit.train._coordinator.blas import _function, _set_threads

        self.gemv = _function(("scipy_cblas_sgemv64_", "cblas_sgemv64_"))
        if self.gemv is None:
            raise SystemExit("--fused needs numpy's OpenBLAS with 64-bit cblas_sgemv")
        i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
        self.gemv.argtypes = [ctypes.c_int, ctypes.c_int, i64, i64, f32, ptr, i64, ptr, i64,
                              f32, ptr, i64]
        self.gemv.restype = None
        _set_threads(1)  # the fold's own threads split the work, not OpenBLAS's pool

    def __call__(self, states: list[dict[str, np.ndarray]], weights: list[float],
                 threads: int) -> list[np.ndarray]:
        keys = list(states[0])
        sizes = [states[0][k].size for k in keys]
        accs = [np.empty(size, dtype=np.float32) for size in sizes]
        factors = [w / weights[0] for w in weights]
        step = CHUNK_ELEMENTS
        work = tasks(sizes, step)
        for pair in range(len(states) // 2):
            first, second = states[2 * pair], states[2 * pair + 1]
            f0, f1 = factors[2 * pair], factors[2 * pair + 1]

            def run(worker: int, task: tuple[int, int, int], pair: int = pair,
                    first: dict[str, np.ndarray] = first, second: dict[str, np.ndarray] = second,
                    f0: float = f0, f1: float = f1) -> list[Any]:
                index, lo, hi = task
                x, y, acc = first[keys[index]], second[keys[index]], accs[index]
                px, py = x.ctypes.data, y.ctypes.data
                wf = np.array([f0, f1] if px < py else [f1, f0], dtype=np.float32)
                base, lda = min(px, py), abs(py - px) // 4
                assert abs(py - px) % 4 == 0 and lda >= hi - lo
                beta = 0.0 if pair == 0 else 1.0
                for start in range(lo, hi, step):
                    stop = min(start + step, hi)
                    self.gemv(102, 111, stop - start, 2, 1.0, base + 4 * start, lda,
                              wf.ctypes.data, 1, beta, acc.ctypes.data + 4 * start, 1)
                    a = acc[start:stop]
                    if not np.dot(a, a) < np.inf:
                        return [(index, start)]
                return []

            assert not run_tasks(run, work, threads)
        total = sum(factors)
        for acc in accs:
            np.divide(acc, total, out=acc)
        return accs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, type=Path, help="a checkout of the code before")
    parser.add_argument("--params", type=float, nargs="+", default=[10e6])
    parser.add_argument("--contributors", type=int, default=10)
    parser.add_argument("--trials", type=int, default=9)
    parser.add_argument("--fused", action="store_true",
                        help="add the rows of a fused kernel (OpenBLAS sgemv; not meshkit's fold)")
    args = parser.parse_args(argv)
    if args.contributors < 2 or args.contributors % 2:
        parser.error("--contributors must be even (the ceiling rows fold pairs)")
    _load("baseline_threads", args.baseline / "meshkit" / "aggregation" / "_threads.py")
    replace = {"from meshkit.aggregation._threads import": "from baseline_threads import"}
    arenas = args.baseline / "meshkit" / "aggregation" / "_arenas.py"
    if arenas.exists():  # the baseline's own arena policy (which sums it keeps), not this tree's
        _load("baseline_arenas", arenas)
        replace["from meshkit.aggregation._arenas import"] = "from baseline_arenas import"
    baseline = _load("baseline_mean", args.baseline / "meshkit" / "aggregation" / "_mean.py",
                     replace).MeanFold
    for params in args.params:
        measure(baseline, int(params), args.contributors, args.trials,
                FusedPairs() if args.fused else None)
    return 0


def measure(baseline: Any, params: int, contributors: int, trials: int,
            fused: FusedPairs | None = None) -> None:
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
    # Results held here would keep their sums' arenas in use, so every timed fold would
    # map fresh pages, as no round does (the coordinator's arena of the round before last
    # is idle, meshkit/aggregation/_arenas.py): the timed folds start as rounds do.
    del old, new
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
    if fused is not None:
        mean = fold(MeanFold, 1)
        for threads in (1, 2):
            got = dict(zip(states[0], fused(states, weights, threads)))
            for key, value in mean.items():  # float32's precision, not the fold's bits
                assert np.allclose(got[key], value, rtol=1e-5, atol=1e-6), "fused differs"
        del mean, got
        rows["fused pairs, 1 thread (not meshkit)"] = (
            lambda: fused(states, weights, 1), fold_bytes)
        rows["fused pairs, 2 threads (not meshkit)"] = (
            lambda: fused(states, weights, 2), fold_bytes)
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
        if label.startswith(("fold", "fused")):
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
