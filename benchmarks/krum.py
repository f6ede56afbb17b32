"""Krum, Multi-Krum and Bulyan: meshkit against Flower 1.42 on the same contributions (issue 36).

Run (from the repository root, in the dev venv with the ``flower`` extra)::

    python benchmarks/krum.py                         # 100 x 1M float32, f = 10
    python benchmarks/krum.py --clients 30 --params 1e5 --repeat 5   # a quick look
    python benchmarks/krum.py --legacy                # also Flower's NDArrays aggregate_krum

Each row runs on the same ``clients`` contributions of ``params`` float32
parameters (in ``arrays`` arrays, unequal example counts), in one process,
the rows interleaved repeat by repeat so a load that comes and goes hits
every row alike:

* meshkit ``krum`` / ``multi-krum`` (``m = n - f``) / ``bulyan``:
  ``aggregate(states, weights)``, the whole rule (stacking the round in
  float64, the Gram matrix, the selection, the result as a state);
* Flower ``Krum`` / ``MultiKrum`` (``flwr.serverapp.strategy``): what their
  ``aggregate_train`` runs on the replies, ``select_multikrum`` then
  ``aggregate_arrayrecords``, on ``RecordDict`` replies built outside the
  timed region (their time includes turning each ``Array`` back into
  numpy, which is how Flower holds arrays);
* with ``--legacy``, Flower's NDArrays ``aggregate_krum`` (the pre-Message
  strategies; an ``n^2`` loop of norms, slow at this size).

Prints best and median seconds and the ratios the issue sets: meshkit
Krum and Multi-Krum over Flower's (target <= 1.0), Bulyan over meshkit
Krum (target <= 3). A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

import meshkit


def make_inputs(clients: int, params: int, arrays: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    per = params // arrays
    base = [rng.standard_normal(per, dtype=np.float32) for _ in range(arrays)]
    # Contributions around one model, as a round's are: the model plus a small update.
    states = [{f"layer{j}": base[j] + np.float32(0.01) * rng.standard_normal(per,
                                                                            dtype=np.float32)
               for j in range(arrays)} for _ in range(clients)]
    weights = [float(w) for w in rng.integers(100, 1000, size=clients)]
    return states, weights


def flower_rows(states, weights, f: int, m: int) -> list[tuple[str, Callable[[], Any]]]:
    import flwr
    from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
    from flwr.serverapp.strategy.multikrum import select_multikrum
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    contents = [RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in s.items()}),
                            "metrics": MetricRecord({"num-examples": w})})
                for s, w in zip(states, weights)]

    def strategy(keep: int) -> Any:
        chosen = select_multikrum(contents, num_malicious_nodes=f, num_nodes_to_select=keep)
        return aggregate_arrayrecords(chosen, "num-examples")

    version = flwr.__version__
    return [(f"flwr {version} Krum (select_multikrum + aggregate_arrayrecords)",
             lambda: strategy(1)),
            (f"flwr {version} MultiKrum, {m} kept", lambda: strategy(m))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--params", type=float, default=1e6)
    parser.add_argument("--arrays", type=int, default=4)
    parser.add_argument("--f", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--legacy", action="store_true",
                        help="also time Flower's NDArrays aggregate_krum (slow)")
    args = parser.parse_args(argv)
    n, f = args.clients, args.f
    m = n - f
    states, weights = make_inputs(n, int(args.params), args.arrays)
    krum = meshkit.plugins.create("aggregator", "krum", {"f": f})
    multi = meshkit.plugins.create("aggregator", "multi-krum", {"f": f, "m": m})
    bulyan = meshkit.plugins.create("aggregator", "bulyan", {"f": f})
    rows: list[tuple[str, Callable[[], Any]]] = [
        ("meshkit krum", lambda: krum.aggregate(states, weights)),
        (f"meshkit multi-krum, m = {m}", lambda: multi.aggregate(states, weights)),
        ("meshkit bulyan", lambda: bulyan.aggregate(states, weights)),
    ]
    rows += flower_rows(states, weights, f, m)
    if args.legacy:
        from flwr.server.strategy.aggregate import aggregate_krum

        results = [([s[k] for k in s], int(w)) for s, w in zip(states, weights)]
        rows.append(("flwr legacy aggregate_krum (NDArrays)",
                     lambda: aggregate_krum(results, f, 0)))

    print(f"krum benchmark: {n} contributions x {int(args.params):,} float32 parameters in "
          f"{args.arrays} arrays, f = {f}; numpy {np.__version__}; best and median of "
          f"{args.repeat} after a warm-up, rows interleaved")
    times: dict[str, list[float]] = {label: [] for label, _ in rows}
    for label, fn in rows:
        fn()  # warm-up
    for _ in range(args.repeat):
        for label, fn in rows:
            gc.collect()
            start = time.perf_counter()
            result = fn()
            times[label].append(time.perf_counter() - start)
            del result
    print(f"\n{'rule':<62} {'best s':>7} {'median':>7}")
    for label, _ in rows:
        print(f"{label:<62} {min(times[label]):7.3f} {statistics.median(times[label]):7.3f}")
    best = {label: min(ts) for label, ts in times.items()}
    labels = [label for label, _ in rows]
    print(f"\nkrum / flwr Krum:             {best[labels[0]] / best[labels[3]]:.2f}x "
          f"(target <= 1.0)")
    print(f"multi-krum / flwr MultiKrum:  {best[labels[1]] / best[labels[4]]:.2f}x "
          f"(target <= 1.0)")
    print(f"bulyan / meshkit krum:        {best[labels[2]] / best[labels[0]]:.2f}x "
          f"(target <= 3.0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
