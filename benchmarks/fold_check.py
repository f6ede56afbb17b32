"""What the strict mean's test per chunk costs a 10M-parameter fold, against the code before, in one process.

Run (from the repository root, in the dev venv)::

    mkdir /tmp/base && git archive BASE | tar -x -C /tmp/base   # the code before
    python benchmarks/fold_check.py --baseline /tmp/base

Issue 34 changed :class:`meshkit.aggregation.MeanFold`'s test per chunk from
``dot(a, zeros)`` (finite: NaN/inf only) to ``dot(a, a)`` (finite, and within
the range). ``benchmarks/nonfinite_scan.py`` times the whole checked fold in
fresh processes; on a loaded machine its spread swamps a few percent. This
one loads the baseline's ``meshkit/aggregation/_mean.py`` beside this tree's
in the same process (the rest of the kernel is shared) and alternates them,
fold for fold, on the same contributions: ``--contributors`` float32
contributions of ``--params`` parameters (four arrays) folded by a weighted
mean, then the result. Printed: ms per contribution for each side, median
(min..max) over ``--trials`` alternations, the ratio of the medians and the
median of the per-pair ratios (> 1: slower than the baseline), and the load;
then the one thing that changed, the test on one cache-resident chunk, both
ways, and what the difference adds up to per fold (it resolves what the
whole fold's spread cannot on a loaded machine).

This is a measurement, not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 1 << 16  # meshkit.aggregation.CHUNK_ELEMENTS


def _baseline_mean(tree: Path) -> Any:
    path = tree / "meshkit" / "aggregation" / "_mean.py"
    spec = importlib.util.spec_from_file_location("baseline_mean", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_mean"] = module
    spec.loader.exec_module(module)
    return module


def _fold(cls: Any, states: list[dict[str, np.ndarray]]) -> float:
    start = time.perf_counter()
    fold = cls(weighted=True, name="fedavg")
    for i, state in enumerate(states):
        fold.add(state, 100.0 + i, source=f"client {i}")
    fold.result()
    return (time.perf_counter() - start) / len(states) * 1e3


def chunk_check(repeats: int = 2001) -> dict[str, float]:
    """Microseconds of each test on one 64Ki-element float32 chunk in cache, interleaved:
    the code before's ``dot(a, zeros) != 0`` and this tree's ``not dot(a, a) < inf``."""
    from meshkit.aggregation import CHUNK_ELEMENTS

    a = np.random.default_rng(1).standard_normal(CHUNK_ELEMENTS, dtype=np.float32)
    zeros = np.zeros_like(a)
    inf = float("inf")
    dot = np.dot
    before: list[float] = []
    now: list[float] = []
    for i in range(repeats):
        for which in ((0, 1) if i % 2 else (1, 0)):
            start = time.perf_counter()
            if which == 0:
                bad = dot(a, zeros) != 0
            else:
                bad = not dot(a, a) < inf
            elapsed = (time.perf_counter() - start) * 1e6
            assert not bad
            (before if which == 0 else now).append(elapsed)
    return {"before_us": statistics.median(before), "now_us": statistics.median(now)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True)
    parser.add_argument("--params", type=int, default=10_000_000)
    parser.add_argument("--contributors", type=int, default=4)
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from meshkit.aggregation import MeanFold

    before = _baseline_mean(args.baseline).MeanFold
    rng = np.random.default_rng(0)
    sizes = [args.params // 4] * 3 + [args.params - 3 * (args.params // 4)]
    states = [{f"w{i}": rng.standard_normal(n, dtype=np.float32) for i, n in enumerate(sizes)}
              for _ in range(args.contributors)]
    load_before = os.getloadavg()
    _fold(MeanFold, states), _fold(before, states)  # warm: arenas, scratch, page faults
    now: list[float] = []
    base: list[float] = []
    for trial in range(args.trials):
        # Alternate which side goes first, so neither always follows the other.
        order = [(MeanFold, now), (before, base)] if trial % 2 == 0 else \
            [(before, base), (MeanFold, now)]
        for cls, out in order:
            out.append(_fold(cls, states))
    load_after = os.getloadavg()
    pair = [a / b for a, b in zip(now, base)]
    chunk = chunk_check()
    figures = {"this": now, "baseline": base, "pair_ratios": pair, "chunk": chunk,
               "ratio_of_medians": statistics.median(now) / statistics.median(base),
               "median_pair_ratio": statistics.median(pair),
               "load": [load_before, load_after]}
    if args.json:
        print(json.dumps(figures))
        return
    print(f"# fedavg MeanFold of {args.contributors} x {args.params:,} float32 params, in one "
          f"process, {args.trials} alternations; ms per contribution; load "
          f"{' '.join(f'{x:.2f}' for x in load_before)} -> "
          f"{' '.join(f'{x:.2f}' for x in load_after)}")
    for name, values in (("this tree", now), ("baseline", base)):
        print(f"{name:>10}: median {statistics.median(values):7.2f}  "
              f"({min(values):.2f}..{max(values):.2f})")
    print(f"ratio of medians: {figures['ratio_of_medians']:.3f}; median of pair ratios: "
          f"{figures['median_pair_ratio']:.3f} ({min(pair):.3f}..{max(pair):.3f})")
    chunks = -(-args.params // CHUNK) * args.contributors  # a test per chunk per fold, at most
    print(f"the test alone, one 64Ki float32 chunk in cache (median of 2001): before "
          f"{chunk['before_us']:.2f} us, now {chunk['now_us']:.2f} us; at most {chunks} tests "
          f"per fold: {chunks * (chunk['now_us'] - chunk['before_us']) / 1e3:+.3f} ms per fold "
          f"of {statistics.median(base) * args.contributors:.1f} ms")


if __name__ == "__main__":
    main()
