"""CPU seconds of the round engine over in-process workers, batched and flat (issue 33).

Run with each tree's own Python, taking turns, so a shared machine's load falls on
every tree alike (the script imports whichever meshkit that Python has installed)::

    for i in 1 2 3 4 5 6 7 8; do
        for tree in /path/to/this /path/to/baseline; do
            echo "$tree $(cut -d' ' -f1 /proc/loadavg) $($tree/.venv/bin/python benchmarks/engine_cpu.py)"
        done
    done

``fold_round`` over a :class:`~meshkit.train.LocalPool` (synchronous: every fit runs
in this process) on ``digits``, 200 clients on 2 workers, ``fedavg``: printed are the
best of ``--repeat`` CPU times (``time.process_time``, not the wall clock, so the time
other processes take does not count, though their cache traffic still does) of one
batched round and of one flat round (``batch=False``), in milliseconds. Set
``OMP_NUM_THREADS=1`` so the fits' BLAS threads do not spin. A benchmark, not a test:
it asserts nothing.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import numpy as np

import meshkit.plugins
from meshkit.train import LocalPool, StrategyContext, Work, client_seed, fold_round


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args(argv)

    def task() -> Any:
        return meshkit.plugins.create("task", "digits", {})

    ranks = list(range(1, args.workers + 1))
    ctx = StrategyContext(task=task(), aggregator=meshkit.plugins.create("aggregator", "fedavg"),
                          pool=LocalPool.of(task, ranks), workers=ranks,
                          rng=np.random.default_rng(0), timeout=60.0)
    state = ctx.task.init_state(0)
    work = [Work(c, {"op": "fit", "shard": c, "shards": args.clients,
                     "seed": client_seed(1, 1, c)}) for c in range(args.clients)]

    def best(run: Callable[[], Any]) -> float:
        run()  # warm-up
        times = []
        for _ in range(args.repeat):
            start = time.process_time()
            run()
            times.append(time.process_time() - start)
        return min(times)

    batched = best(lambda: fold_round(ctx, work, state=state))
    flat = best(lambda: fold_round(ctx, work, state=state, batch=False))
    print(f"{batched * 1e3:.1f} {flat * 1e3:.1f}")


if __name__ == "__main__":
    main()
