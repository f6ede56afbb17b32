"""The flat compressed round's fold, before and after issue 37's change: seconds and peak memory.

Run (from the repository root)::

    python benchmarks/compressed_fold.py                        # 4 Mi coordinates, 8 payloads
    python benchmarks/compressed_fold.py --coords 1048576 --repeat 3 --schemes quantize-8

Before this branch the flat compressed round decoded each pulled payload whole
(``decode_contribution``: a float32 update, the model rebuilt in float64, rounded
to float32) and folded it with the aggregator's streaming mean (``fedavg``'s
``MeanFold``, float32 accumulators); after, a linear rule sums each payload into
one ``CompressedSum``, 16 Ki coordinates at a time, into int64 fixed point. Both
code paths are in this tree unchanged (``decode_contribution`` and ``MeanFold``
are main's), so they run here side by side on the same payloads, interleaved
repeat by repeat so the machine's load falls on both alike.

Printed per scheme: seconds to fold the payloads and take the mean (median over
``--repeat``, with min and max), the ratio after / before (of the medians, and
the range of the per-repeat ratios), and each path's peak traced allocation
while folding (tracemalloc, one pass, not timed) in MiB and in float32 copies of
the model. With ``--per-payload N``, the least seconds one payload costs each
path over N tries (the figure load disturbs least). The fold's own state (MeanFold's float32 sums; CompressedSum's int64
sums, allocated when it is built) is part of the peak. A benchmark: it asserts
nothing.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import meshkit  # noqa: E402
from meshkit.compression import CompressedSum, decode_contribution, encode_update  # noqa: E402

SCHEMES: dict[str, dict[str, Any]] = {
    "quantize-8": {"name": "quantize", "bits": 8},
    "quantize-8-rotated": {"name": "quantize", "bits": 8, "rotate": True},
    "top-k-1%": {"name": "top-k", "fraction": 0.01, "error_feedback": False},
}
MiB = 1 << 20


def payloads(compressor: Any, start: dict[str, np.ndarray], n: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(1)
    out = []
    for i in range(n):
        fitted = {k: v + rng.standard_normal(v.size).astype(np.float32) * np.float32(0.01)
                  for k, v in start.items()}
        out.append(encode_update(compressor, start, fitted, seed=i)[0])
    return out


def before(compressor: Any, start: dict[str, np.ndarray], sent: list[dict[str, Any]],
           weights: list[float]) -> dict[str, Any]:
    """The flat round on main: each payload decoded whole, then the strict mean's fold."""
    fold = meshkit.plugins.create("aggregator", "fedavg").begin()
    for i, (payload, w) in enumerate(zip(sent, weights)):
        contribution, _ = decode_contribution(compressor, payload, start)
        fold.add(contribution, w, source=f"client {i}")
        del contribution
    return fold.result()


def after(compressor: Any, start: dict[str, np.ndarray], sent: list[dict[str, Any]],
          weights: list[float]) -> dict[str, Any]:
    """This branch: each payload summed chunk by chunk into one exact sum."""
    summed = CompressedSum(compressor, start)
    for i, (payload, w) in enumerate(zip(sent, weights)):
        summed.add(payload, w, source=f"client {i}")
    return summed.result()


def per_payload(compressor: Any, start: dict[str, np.ndarray], payload: dict[str, Any],
                n: int) -> tuple[float, float]:
    """The least seconds, over ``n`` tries taking turns, one payload costs each path: before,
    ``decode_contribution`` and ``MeanFold.add`` (which folds pairs: the pair's cost halved);
    after, ``CompressedSum.add``. The least of many tries is what load least disturbs."""
    fold = meshkit.plugins.create("aggregator", "fedavg").begin()
    summed = CompressedSum(compressor, start)
    best = {"before": math.inf, "after": math.inf}
    for i in range(n):
        t0 = time.perf_counter()
        for j in range(2):
            contribution, _ = decode_contribution(compressor, payload, start)
            fold.add(contribution, 1.0, source=f"{i}.{j}")
        best["before"] = min(best["before"], (time.perf_counter() - t0) / 2)
        t0 = time.perf_counter()
        summed.add(payload, 1.0, source=str(i))
        best["after"] = min(best["after"], time.perf_counter() - t0)
    return best["before"], best["after"]


def peak(path: Callable[..., Any], *args: Any) -> int:
    tracemalloc.start()
    try:
        path(*args)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--coords", type=int, default=1 << 22,
                        help="float32 coordinates of the model (one key)")
    parser.add_argument("--payloads", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--per-payload", type=int, default=0, metavar="N",
                        help="also the least seconds one payload costs each path over N tries")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    start = {"w": rng.standard_normal(args.coords).astype(np.float32)}
    copy = start["w"].nbytes
    weights = [float(100 + 7 * i) for i in range(args.payloads)]
    print(f"# {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; "
          f"{args.coords} float32 coordinates ({copy / MiB:.0f} MiB), {args.payloads} "
          f"payloads, {args.repeat} repeats", flush=True)
    print(f"{'scheme':>20} {'before s':>22} {'after s':>22} {'after/before':>22} "
          f"{'peak before':>18} {'peak after':>18}", flush=True)
    for name in args.schemes.split(","):
        options = {k: v for k, v in SCHEMES[name].items() if k != "name"}
        compressor = meshkit.plugins.create("compression", SCHEMES[name]["name"], options)
        sent = payloads(compressor, start, args.payloads)
        times: dict[str, list[float]] = {"before": [], "after": []}
        for _ in range(args.repeat):
            for label, path in (("before", before), ("after", after)):
                t0 = time.perf_counter()
                path(compressor, start, sent, weights)
                times[label].append(time.perf_counter() - t0)
        ratios = [a / b for a, b in zip(times["after"], times["before"])]
        peaks = {label: peak(path, compressor, start, sent, weights)
                 for label, path in (("before", before), ("after", after))}

        def shown(values: list[float]) -> str:
            return (f"{statistics.median(values):.3f} ({min(values):.3f}-"
                    f"{max(values):.3f})")

        print(f"{name:>20} {shown(times['before']):>22} {shown(times['after']):>22} "
              f"{statistics.median(times['after']) / statistics.median(times['before']):>8.2f}"
              f" ({min(ratios):.2f}-{max(ratios):.2f})"
              f" {peaks['before'] / MiB:>8.1f} ({peaks['before'] / copy:.1f}x)"
              f" {peaks['after'] / MiB:>8.1f} ({peaks['after'] / copy:.1f}x)", flush=True)
        if args.per_payload:
            one_before, one_after = per_payload(compressor, start, sent[0], args.per_payload)
            print(f"{'':>20} one payload, least of {args.per_payload}: before "
                  f"{one_before * 1e3:.2f} ms, after {one_after * 1e3:.2f} ms, after/before "
                  f"{one_after / one_before:.2f}", flush=True)
    print(f"# load average after: {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
