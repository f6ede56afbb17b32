"""FedAvg aggregation throughput and memory: meshkit vs Flower vs plain numpy.

Run (from the repository root, in the dev venv; Flower is optional, from the
``bench`` extra)::

    python benchmarks/aggregate.py                  # 10 x 10M float32 in 10 arrays
    python benchmarks/aggregate.py --params 1e6     # a quick look

Prints, side by side for the same inputs:

* ``read bandwidth``: ``np.sum`` over every input array, the memory-bound
  floor any aggregation must read through;
* meshkit ``fedavg`` streaming fold (``begin`` / ``add`` / ``result``);
* meshkit ``fedavg`` batch ``aggregate`` (the same fold underneath);
* Flower's current FedAvg aggregation, ``aggregate_arrayrecords`` (what
  ``flwr.serverapp.strategy.FedAvg.aggregate_train`` calls), when ``flwr``
  is installed, and its legacy NDArrays ``aggregate`` for reference;
* plain numpy in-place weighted accumulation (``multiply(out=)`` into a
  full-size scratch, ``add(out=)``, one division);
* meshkit ``FixedPointSum`` (issue 22): the exact int64 sum a worker folds
  its clients into, and, after the table, its cost per contribution of a
  digits-sized model (four small float64 arrays) against ``MeanFold``'s,
  where the per-call overhead is the whole cost.

Throughput is input bytes per second; "x read" is the ratio to the
read-bandwidth figure and "x flwr" the speed-up over Flower's current path.
Extra peak memory is measured separately with tracemalloc (numpy reports
its allocations to it) and shown in model copies. Targets (issue 3):
streaming fold >= 0.6x read, >= 2.5x Flower, extra peak <= 2 model copies
whatever the number of contributors. This is a benchmark, not a test: it
asserts nothing and its numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

import meshkit.plugins
from meshkit.aggregation import FixedPointSum, MeanFold, begin


def make_inputs(contributors: int, params: int, arrays: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    per = params // arrays
    states = [{f"layer{j}": rng.standard_normal(per, dtype=np.float32) for j in range(arrays)}
              for _ in range(contributors)]
    # Realized work differs between clients, so the weights differ too.
    weights = [float(w) for w in rng.integers(100, 1000, size=contributors)]
    return states, weights


def read_bandwidth(states) -> None:
    for state in states:
        for value in state.values():
            np.sum(value)


def read_bandwidth_threaded(states, pool) -> None:
    """``np.sum`` over the inputs, half of the arrays on each of two threads."""
    arrays = [value for state in states for value in state.values()]
    halves = [arrays[0::2], arrays[1::2]]
    for future in [pool.submit(lambda part: [np.sum(v) for v in part], half)
                   for half in halves]:
        future.result()


def meshkit_fold(aggregator, states, weights) -> dict:
    fold = begin(aggregator)
    for i, (state, weight) in enumerate(zip(states, weights)):
        fold.add(state, weight, source=f"rank {i + 1}")
    return fold.result()


def fixed_point(states, weights) -> dict:
    total = FixedPointSum()
    for i, (state, weight) in enumerate(zip(states, weights)):
        total.add(state, weight, source=f"rank {i + 1}")
    return total.result()


def small_model_adds(fold: Any, n: int = 2000) -> float:
    """Seconds per ``add`` of a digits-sized state (64x32, 32, 32x10, 10 float64)."""
    rng = np.random.default_rng(1)
    state = {"hidden.w": rng.standard_normal((64, 32)), "hidden.b": rng.standard_normal(32),
             "output.w": rng.standard_normal((32, 10)), "output.b": rng.standard_normal(10)}
    fold.add(state, 9.0)
    start = time.perf_counter()
    for _ in range(n):
        fold.add(state, 9.0)
    return (time.perf_counter() - start) / n


def meshkit_batch(aggregator, states, weights) -> dict:
    return aggregator.aggregate(states, weights)


def numpy_inplace(states, weights) -> dict:
    total = float(sum(weights))
    out = {k: np.zeros_like(v) for k, v in states[0].items()}
    scratch = {k: np.empty_like(v) for k, v in states[0].items()}
    for state, weight in zip(states, weights):
        for key, value in state.items():
            np.multiply(value, weight, out=scratch[key])
            np.add(out[key], scratch[key], out=out[key])
    for value in out.values():
        np.divide(value, total, out=value)
    return out


def flower_setup(states, weights):
    """Flower's inputs, built outside the timed region: RecordDicts as replies carry them."""
    try:
        from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
        from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords
    except ImportError:
        return None
    records = [
        RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in state.items()}),
                    "metrics": MetricRecord({"num-examples": weight})})
        for state, weight in zip(states, weights)
    ]
    return records, aggregate_arrayrecords


def flower_legacy_setup(states, weights):
    try:
        from flwr.server.strategy.aggregate import aggregate
    except ImportError:
        return None
    results = [([state[k] for k in state], int(weight)) for state, weight in zip(states, weights)]
    return results, aggregate


def timed(fn: Callable[[], Any], repeat: int) -> list[float]:
    fn()  # warm-up: imports, first-touch of scratch memory
    times = []
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
        del result
    return times


def extra_peak(fn: Callable[[], Any]) -> int:
    """Bytes allocated at the peak of ``fn`` beyond what existed before it."""
    gc.collect()
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        result = fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del result
    return peak - before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contributors", type=int, default=10)
    parser.add_argument("--params", type=float, default=10e6,
                        help="float32 parameters per contribution (default 10M)")
    parser.add_argument("--arrays", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args(argv)
    params = int(args.params)

    states, weights = make_inputs(args.contributors, params, args.arrays)
    model_bytes = sum(v.nbytes for v in states[0].values())
    input_bytes = model_bytes * len(states)
    fedavg = meshkit.plugins.create("aggregator", "fedavg")
    # Holding two contributions instead of one: less accumulator traffic, one
    # more model copy retained (not allocated: tracemalloc does not see it).
    fedavg_retain2 = meshkit.plugins.create("aggregator", "fedavg", {"retain": 2})
    fedavg_wide = meshkit.plugins.create("aggregator", "fedavg", {"accumulate": "float64"})
    # The fold on the calling thread alone (the default splits large folds
    # across two threads).
    fedavg_1thread = meshkit.plugins.create("aggregator", "fedavg", {"threads": 1})

    print(f"meshkit aggregate benchmark: {args.contributors} contributions x {params:,} "
          f"float32 parameters in {args.arrays} arrays ({model_bytes / 1e6:.0f} MB per model, "
          f"{input_bytes / 1e6:.0f} MB of input); numpy {np.__version__}; "
          f"fold threads {fedavg.threads} (of {os.cpu_count()} cores); "
          f"best of {args.repeat} after a warm-up")

    pool = ThreadPoolExecutor(2)
    rows: list[tuple[str, Callable[[], Any] | None, str]] = [
        ("read bandwidth (np.sum over the inputs)", lambda: read_bandwidth(states), ""),
        # For reference, not a ratio's base: what two cores read together.
        ("read bandwidth, 2 threads (np.sum, half each)",
         lambda: read_bandwidth_threaded(states, pool), ""),
        ("meshkit fedavg, streaming fold", lambda: meshkit_fold(fedavg, states, weights), ""),
        ("meshkit fedavg, batch aggregate", lambda: meshkit_batch(fedavg, states, weights), ""),
        ("meshkit fedavg, streaming fold, threads = 1",
         lambda: meshkit_fold(fedavg_1thread, states, weights), ""),
        ("meshkit fedavg, streaming fold, retain = 2",
         lambda: meshkit_fold(fedavg_retain2, states, weights), ""),
        ('meshkit fedavg, streaming fold, accumulate = "float64"',
         lambda: meshkit_fold(fedavg_wide, states, weights), ""),
    ]
    flower = flower_setup(states, weights)
    if flower is not None:
        import flwr

        records, aggregate_arrayrecords = flower
        rows.append((f"flwr {flwr.__version__} FedAvg (aggregate_arrayrecords)",
                     lambda: aggregate_arrayrecords(records, "num-examples"), "flwr"))
        legacy = flower_legacy_setup(states, weights)
        if legacy is not None:
            results, aggregate = legacy
            rows.append((f"flwr {flwr.__version__} legacy aggregate (NDArrays)",
                         lambda: aggregate(results), ""))
    else:
        rows.append(("flwr FedAvg: not installed (pip install 'meshkit[bench]')", None, ""))
    rows.append(("numpy in-place weighted accumulation", lambda: numpy_inplace(states, weights),
                 ""))
    rows.append(("meshkit FixedPointSum (exact, int64 sums)",
                 lambda: fixed_point(states, weights), ""))

    figures: dict[str, float] = {}
    peaks: dict[str, int] = {}
    for label, fn, _ in rows:
        if fn is None:
            continue
        times = timed(fn, args.repeat)
        figures[label] = min(times)
        figures[label + " median"] = statistics.median(times)
        if not label.startswith("read"):
            peaks[label] = extra_peak(fn)

    read = figures[rows[0][0]]
    flwr_time = next((figures[label] for label, fn, tag in rows if tag == "flwr"), None)
    print(f"\n{'method':<56} {'best ms':>8} {'median':>8} {'GB/s':>7} {'x read':>7} "
          f"{'x flwr':>7} {'extra peak':>11} {'copies':>7}")
    for label, fn, _ in rows:
        if fn is None:
            print(f"{label:<56}")
            continue
        best = figures[label]
        speed = input_bytes / best / 1e9
        vs_flower = f"{flwr_time / best:7.2f}" if flwr_time else f"{'-':>7}"
        peak = peaks.get(label)
        peak_text = f"{peak / 1e6:8.1f} MB" if peak is not None else f"{'-':>11}"
        copies = f"{peak / model_bytes:7.2f}" if peak is not None else f"{'-':>7}"
        print(f"{label:<56} {best * 1e3:8.1f} {figures[label + ' median'] * 1e3:8.1f} "
              f"{speed:7.2f} {read / best:7.2f} {vs_flower} {peak_text} {copies}")

    fixed = [small_model_adds(FixedPointSum()) for _ in range(3)]
    mean = [small_model_adds(MeanFold()) for _ in range(3)]
    print(f"\na digits-sized contribution (2,410 float64 in 4 arrays), per add, best of 3 "
          f"x 2000: FixedPointSum {min(fixed) * 1e6:.0f} us, MeanFold {min(mean) * 1e6:.0f} us "
          f"(ratio {min(fixed) / min(mean):.2f})")

    # Extra peak memory of the streaming fold as the number of contributors grows
    # (the same inputs re-sent, so the process stays small).
    print("\nstreaming fold extra peak memory by number of contributors:")
    for n in (2, args.contributors, 3 * args.contributors):
        repeated = [states[i % len(states)] for i in range(n)]
        ws = [weights[i % len(weights)] for i in range(n)]
        peak = extra_peak(lambda r=repeated, w=ws: meshkit_fold(fedavg, r, w))
        print(f"  {n:3d} contributors: {peak / 1e6:7.1f} MB = {peak / model_bytes:.2f} model "
              f"copies")
    return 0


if __name__ == "__main__":
    sys.exit(main())
