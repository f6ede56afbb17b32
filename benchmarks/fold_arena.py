"""A round's sum into a kept arena or into fresh memory (issue 39).

Run (from the repository root, in the dev venv)::

    python benchmarks/fold_arena.py                    # 100M float32 (400 MB), 2 contributions
    python benchmarks/fold_arena.py --params 25e6 --rounds 6 --repeat 5

Rounds as the coordinator plays them: each round folds ``--contributions``
model-sized contributions with :class:`meshkit.aggregation.MeanFold` and its
result replaces the model held from the round before (which is dropped
then). *fresh*: every sum is a new arena (the code before issue 39's change,
forced by raising ``_arenas.ARENA_MIN`` above the model); *kept*: the arena of
the round before last is reused. The two take turns trial by trial; a trial
is ``--rounds`` rounds, and its seconds, minor page faults and system CPU
(``getrusage`` of this process) are of the folds alone, rounds after the
first. Printed: the medians and ranges, the ratio per pair of trials, and the
load average before and after. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import numpy as np

from meshkit.aggregation import MeanFold
from meshkit.aggregation import _arenas


def trial(contributions: list[dict], rounds: int) -> tuple[float, int, float]:
    seconds, faults, system = 0.0, 0, 0.0
    model = None
    for i in range(rounds):
        before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        fold = MeanFold(weighted=True)
        for state in contributions:
            fold.add(state, 1.0)
        result = fold.result()
        after, ended = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        model = result  # the round before's model is dropped here, as the runner's
        del result
        if i:
            seconds += ended - started
            faults += after.ru_minflt - before.ru_minflt
            system += after.ru_stime - before.ru_stime
    del model
    return seconds, faults, system


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--contributions", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    params = int(args.params)
    rng = np.random.default_rng(0)
    contributions = [{"w": rng.standard_normal(params, dtype=np.float32)}
                     for _ in range(args.contributions)]
    load = os.getloadavg()
    print(f"# {params:,} float32 ({params * 4 / 1e6:.0f} MB), {args.contributions} "
          f"contributions a round, {args.rounds} rounds a trial, {args.repeat} trials each "
          f"way; load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    keep = _arenas.ARENA_MIN
    got: dict[str, list[tuple[float, int, float]]] = {"fresh": [], "kept": []}
    for i in range(args.repeat):
        for way in (("fresh", "kept") if i % 2 == 0 else ("kept", "fresh")):
            _arenas.forget_arenas()
            _arenas.ARENA_MIN = 1 << 62 if way == "fresh" else keep
            got[way].append(trial(contributions, args.rounds))
            s, f, t = got[way][-1]
            print(f"# trial {i + 1} {way}: {s:.3f} s, {f:,} minor faults, system {t:.2f} s "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
    _arenas.ARENA_MIN = keep
    folds = args.rounds - 1
    for way, rows in got.items():
        secs = [r[0] / folds for r in rows]
        print(f"{way}: {statistics.median(secs):.3f} s a round's fold ({min(secs):.3f}-"
              f"{max(secs):.3f}), {statistics.median(r[1] for r in rows) / folds:,.0f} minor "
              f"faults, system {statistics.median(r[2] for r in rows) / folds:.3f} s")
    ratios = [f[0] / k[0] for f, k in zip(got["fresh"], got["kept"])]
    print(f"fresh / kept per trial: {statistics.median(ratios):.2f}x "
          f"({min(ratios):.2f}-{max(ratios):.2f})")
    load = os.getloadavg()
    print(f"load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
