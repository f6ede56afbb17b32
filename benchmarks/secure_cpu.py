"""CPU seconds of one SecAgg+ round against the plain round it replaces, in one process (issue 36).

Run (from the repository root, in the dev venv)::

    python benchmarks/secure_cpu.py                     # n = 100, 100k parameters, 4 workers
    python benchmarks/secure_cpu.py --profile 25        # and cProfile's top 25 (tottime)
    python benchmarks/secure_cpu.py --degree 20 --threshold 11

Both rounds run over a :class:`~meshkit.train.LocalPool` of ``--workers``
in-process :class:`~meshkit.train.Trainer` s (every message still crosses the
wire encoding and its schema checks), ``synthetic`` task with ``--params``
float32 parameters, all ``--clients`` clients, ``fedavg``: the plain round
is :func:`~meshkit.train.fold_round` over ``fit`` work, the secure round
:func:`~meshkit.train.secure_sum` with ``secagg+`` at its defaults
(``degree = "auto"``: 8, threshold 5 at n = 100 over 4 workers with the
cohort placed along the ring, 50 and 26 with ``--interleave false``;
``clip_range = 1``). They take turns, ``--repeat`` times.

CPU seconds (``time.process_time``: other processes' time does not count,
so the figure moves less with the machine's load than a wall clock does),
median over the trials, and the secure round's split by worker step
(``secagg_keys``, ``_share``, ``_open``, ``_mask`` with its fits,
``_unmask``) and the coordinator (everything else: routing, the server's
checks and unmasking). Printed: each, the secure round's total and its
ratio to the plain round. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import logging
import os
import pstats
import statistics
import time
from typing import Any

import numpy as np

import meshkit
from meshkit.secure_aggregation import choose
from meshkit.train import (
    LocalPool,
    StrategyContext,
    Trainer,
    Work,
    client_seed,
    fold_round,
    secure_sum,
)
from meshkit.train._worker.secure import SecureClients

STEPS = ("secagg_keys", "secagg_share", "secagg_open", "secagg_mask", "secagg_unmask")


def _context(clients: int, workers: int, params: int) -> StrategyContext:
    def task() -> Any:
        return meshkit.plugins.create("task", "synthetic", {"params": params,
                                                         "rows": 2 * clients})

    ranks = list(range(1, workers + 1))
    return StrategyContext(
        task=task(), aggregator=meshkit.plugins.create("aggregator", "fedavg"),
        pool=LocalPool({r: Trainer(task()) for r in ranks}), workers=ranks,
        rng=np.random.default_rng(0), seed=3,
        outer=meshkit.plugins.create("outer_optimizer", "average"), timeout=600.0)


#: The leaves of the protocol's cost: (module, function) pairs, each timed where it is called.
PRIMITIVES = {
    "X25519 agreement": ("agree", ("_agreement", "_client", "_server")),
    "X25519 key pair": ("generate_private", ("_agreement", "_client")),
    "mask expansion": ("mask_vector", ("_client", "_server")),
    "mask add": ("add_mod", ("_client", "_server")),
    "mask subtract": ("sub_mod", ("_client", "_server")),
    "HKDF": ("derive", ("_agreement", "_client", "_server")),
    "AES-GCM seal": ("seal", ("_agreement",)),
    "AES-GCM open": ("open_sealed", ("_agreement",)),
    "Shamir split": ("shamir_split", ("_client",)),
    "Shamir combine": ("shamir_combine", ("_server",)),
}


def _by_primitive(run: Any) -> dict[str, tuple[int, float]]:
    """CPU seconds and calls of each of :data:`PRIMITIVES` during ``run()`` (timers patched in)."""
    import importlib

    spent: dict[str, list[float]] = {name: [0, 0.0] for name in PRIMITIVES}
    patched = []

    def timer(name: str, function: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                spent[name][0] += 1
                spent[name][1] += time.process_time() - start
        return timed

    for name, (function, modules) in PRIMITIVES.items():
        for module_name in modules:
            module = importlib.import_module(f"meshkit_secagg.{module_name}")
            if hasattr(module, function):
                original = getattr(module, function)
                patched.append((module, function, original))
                setattr(module, function, timer(name, original))
    try:
        start = time.process_time()
        run()
        total = time.process_time() - start
    finally:
        for module, function, original in patched:
            setattr(module, function, original)
    out = {name: (int(c), s) for name, (c, s) in spent.items()}
    out["(round, all of it)"] = (1, total)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--params", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--degree", default="auto")
    parser.add_argument("--threshold", default="auto")
    parser.add_argument("--interleave", choices=("true", "false"), default="true",
                        help="[secure_aggregation] interleave: place the cohort along the ring")
    parser.add_argument("--primitives", action="store_true",
                        help="also split one more secure round's CPU by cryptographic primitive")
    parser.add_argument("--profile", type=int, default=0,
                        help="print cProfile's top N functions of one more secure round")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    options: dict[str, Any] = {"clip_range": 1.0, "interleave": args.interleave == "true"}
    for key in ("degree", "threshold"):
        value = getattr(args, key)
        options[key] = value if value == "auto" else (float(value) if "." in value
                                                      else int(value))
    scheme = choose("secagg+", options)
    ctx = _context(args.clients, args.workers, args.params)
    state = ctx.task.init_state(3)
    clients = list(range(args.clients))
    seeds = {c: client_seed(3, 1, c) for c in clients}
    work = [Work(c, {"op": "fit", "shard": c, "shards": args.clients, "seed": seeds[c]})
            for c in clients]

    steps: dict[str, float] = collections.defaultdict(float)
    handle = SecureClients.handle

    def timed(self: SecureClients, op: str, request: Any, fit: Any) -> Any:
        start = time.process_time()
        try:
            return handle(self, op, request, fit)
        finally:
            steps[op] += time.process_time() - start

    SecureClients.handle = timed  # type: ignore[method-assign]

    def plain() -> None:
        fold_round(ctx, work, state=state)

    def secure() -> None:
        result = secure_sum(ctx, clients, state=state, scheme=scheme, rnd=1,
                            shards=args.clients, seeds=seeds)
        assert len(result.contributors) == args.clients

    params = meshkit.train.round_params(
        scheme, args.clients, per_worker=-(-args.clients // args.workers),
        interleave=min(args.workers, args.clients) if args.interleave == "true" else 0)
    print(f"load average {os.getloadavg()[0]:.1f}; n = {args.clients}, {args.workers} workers, "
          f"{args.params} parameters; degree {params.degree}, threshold {params.threshold}")
    plain()
    secure()  # warm-up: imports, the task's data
    times: dict[str, list[float]] = {"plain": [], "secure": []}
    split: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(args.repeat):
        for name, run in (("plain", plain), ("secure", secure)):
            steps.clear()
            start = time.process_time()
            run()
            times[name].append(time.process_time() - start)
            if name == "secure":
                for op in STEPS:
                    split[op].append(steps.get(op, 0.0))
                split["coordinator"].append(times[name][-1] - sum(steps.values()))
    med = {name: statistics.median(t) for name, t in times.items()}
    for name in ("plain", "secure"):
        t = times[name]
        print(f"{name:>20}: {med[name]:.3f} s CPU ({min(t):.3f}-{max(t):.3f})")
    for op, t in split.items():
        print(f"{'  ' + op:>20}: {statistics.median(t):.3f} s")
    print(f"{'secure / plain':>20}: {med['secure'] / med['plain']:.2f}")
    if args.primitives:
        spent = _by_primitive(secure)
        for name, (calls, seconds) in sorted(spent.items(), key=lambda kv: -kv[1][1]):
            print(f"{name:>20}: {seconds:.3f} s in {calls} calls")
    if args.profile:
        profiler = cProfile.Profile(time.process_time)
        profiler.runcall(secure)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
