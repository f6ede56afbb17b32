"""The service against a fresh ``meshkit run``: time to the first round, and memory over many runs.

Run (from the repository root, in the dev venv, with the ``serve`` extra)::

    python benchmarks/serve.py                   # both measurements, defaults below
    python benchmarks/serve.py --repeat 5 --runs 100 --rounds 10
    python benchmarks/serve.py --memory-only --no-auto-gc   # part 2 alone, collector off

1. **Submit to first round** on a warm service (the service and its nodes
   already up, as in production) against the baseline, a fresh ``meshkit
   run`` of the same config (``launch = "local"``: it spawns its workers,
   which then import numpy and build the task), same run: the seconds from
   ``submit`` (resp. ``meshkit.run``) to the first round's event. Printed:
   the median over ``--repeat`` runs of each, the spread (max - min), and
   the ratio fresh / warm.
2. **Memory flat** over ``--runs`` x ``--rounds`` rounds of small runs
   through one service (default 100 x 10 = 1,000 rounds): tracemalloc's
   current traced bytes in the service process after the first tenth of the
   runs, at every further tenth, and after the last, and the growth per run
   between the first tenth and the last. Each is taken once the run is
   reported ended (the service collects an ended run before it says so:
   meshkit/service/_runs.py, "Memory"). ``--no-auto-gc`` turns CPython's
   automatic cycle collector off for this part, so the figure cannot depend
   on when it happened to run.

The service runs in this process (so tracemalloc sees it); its nodes are
real ``meshkit node --service`` processes. A benchmark, not a test: it
asserts nothing, and its numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
import tracemalloc
from pathlib import Path
from typing import Any

import meshkit
from meshkit.service import ServeConfig, Service

CONFIG = """
[run]
task = "digits"
seed = {seed}
out = "{out}"

[mesh]
workers = {workers}

[strategy]
name = "federated"
rounds = {rounds}

[aggregator]
name = "fedavg"

[task]
hidden = 8
"""


def _first_round_fresh(root: Path, seed: int, workers: int) -> float:
    """Seconds from meshkit.run(...) to its first round event (local launch)."""
    text = CONFIG.format(seed=seed, out=root / f"fresh{seed}", workers=workers, rounds=2)
    started = time.perf_counter()
    first: list[float] = []

    def progress(event: Any) -> None:
        if event.kind == "round" and not first:
            first.append(time.perf_counter() - started)

    meshkit.run(tomllib.loads(text), progress=progress)
    return first[0]


def _wait_round(service: Service, run: str, round_: int, timeout: float = 300) -> None:
    assert service.store is not None
    deadline = time.monotonic() + timeout
    after = 0
    while time.monotonic() < deadline:
        for event in service.store.wait_events(run, after=after, timeout=5):
            after = event.seq
            if event.kind == "round" and event.data and event.data["round"] >= round_:
                return
        record = service.store.run(run)
        if record is not None and record.state in ("finished", "failed", "stopped"):
            if record.rounds_completed >= round_:
                return
            raise RuntimeError(f"{run} ended: {record.error}")
    raise RuntimeError(f"{run}: no round {round_} within {timeout} s")


def _wait_done(service: Service, run: str, timeout: float = 300) -> None:
    assert service.store is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        service.store.wait_events(run, after=10**9, timeout=5)
        record = service.store.run(run)
        if record is not None and record.state in ("finished", "failed", "stopped"):
            if record.state != "finished":
                raise RuntimeError(f"{run}: {record.state}: {record.error}")
            return
    raise RuntimeError(f"{run} did not finish")


def _nodes(service: Service, n: int, root: Path) -> list[subprocess.Popen]:
    procs = []
    for i in range(n):
        proc = subprocess.Popen(
            [sys.executable, "-m", "meshkit", "node", "--service", service.node_address,
             "--secret-file", str(service.state / "nodes.secret")],
            stdout=subprocess.PIPE, stderr=open(root / f"node{i}.err", "wb"), text=True)
        assert proc.stdout is not None
        proc.stdout.readline()  # {"event": "joined"}
        procs.append(proc)
    return procs


def _print_first_round(warm: list[float], fresh: list[float], args: Any) -> None:
    print(f"submit -> first round, {args.workers} workers, digits federated "
          f"(median of {args.repeat}, spread max-min):")
    print(f"  warm service      {statistics.median(warm):7.3f} s  "
          f"(spread {max(warm) - min(warm):.3f})")
    print(f"  fresh meshkit run {statistics.median(fresh):7.3f} s  "
          f"(spread {max(fresh) - min(fresh):.3f})")
    print(f"  ratio fresh / warm: {statistics.median(fresh) / statistics.median(warm):.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--memory-only", action="store_true",
                        help="skip part 1 (submit to first round)")
    parser.add_argument("--no-auto-gc", action="store_true",
                        help="part 2 with the automatic cycle collector off")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="meshkit-bench-serve-"))
    tracemalloc.start()
    service = Service(ServeConfig(state_dir=str(root / "state")))
    service.start()
    nodes = _nodes(service, args.workers, root)
    try:
        # Warm means warm: one run first, so the service has imported and built
        # what every run needs (the nodes have too) before anything is timed.
        _wait_done(service, service.submit("warmup.toml", CONFIG.format(
            seed=99, out="x", workers=args.workers, rounds=2)).id)
        warm: list[float] = []
        fresh: list[float] = []
        for i in range(0 if args.memory_only else args.repeat):
            text = CONFIG.format(seed=i, out="x", workers=args.workers, rounds=2)
            started = time.perf_counter()
            run = service.submit("bench.toml", text).id
            _wait_round(service, run, 1)
            warm.append(time.perf_counter() - started)
            _wait_done(service, run)
            fresh.append(_first_round_fresh(root, i, args.workers))
        if warm:
            _print_first_round(warm, fresh, args)
        tenth = max(1, args.runs // 10)
        marks: dict[str, int] = {}
        series: list[int] = []
        if args.no_auto_gc:
            gc.disable()
        for i in range(args.runs):
            text = CONFIG.format(seed=100 + i, out="x", workers=args.workers, rounds=args.rounds)
            _wait_done(service, service.submit("small.toml", text).id)
            if (i + 1) % tenth == 0:
                series.append(tracemalloc.get_traced_memory()[0])
            if i + 1 == tenth:
                marks["after_tenth"] = tracemalloc.get_traced_memory()[0]
        gc.enable()
        marks["after_all"] = tracemalloc.get_traced_memory()[0]
        grown = marks["after_all"] - marks["after_tenth"]
        per_run = grown / max(1, args.runs - tenth)
        print(f"memory over {args.runs} runs x {args.rounds} rounds = "
              f"{args.runs * args.rounds} rounds (tracemalloc, service process, automatic "
              f"collector {'off' if args.no_auto_gc else 'on'}):")
        print(f"  after {tenth} runs {marks['after_tenth'] / 1e6:8.2f} MB; after {args.runs} runs "
              f"{marks['after_all'] / 1e6:8.2f} MB; growth {grown / 1e3:+.1f} kB "
              f"({per_run / 1e3:+.2f} kB per run)")
        print("  every tenth (MB): " + " ".join(f"{b / 1e6:.2f}" for b in series))
        print(json.dumps({"warm": warm, "fresh": fresh, **marks, "series": series}))
    finally:
        for proc in nodes:
            proc.terminate()
        for proc in nodes:
            proc.wait(timeout=30)
        service.close()


if __name__ == "__main__":
    main()
