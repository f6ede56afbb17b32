"""Coordinator memory and seconds per round of ``meshkit run`` federated, by worker count.

Run (from the repository root, in the dev venv)::

    python benchmarks/round_memory.py                       # the issue's grid, this tree
    python benchmarks/round_memory.py --baseline ../base    # and the pre-engine tree beside it
    python benchmarks/round_memory.py --params 1e6 --workers 2 4 --rounds 2   # a quick look
    python benchmarks/round_memory.py --clients-per-worker 4 ...   # batched rounds (issue 22)
    python benchmarks/round_memory.py --quantize 8 --baseline ../base ...  # issue 37's flat
                                                                    # compressed round

Each cell is a real ``meshkit run``: a federated job (one client per
worker, ``average`` outer optimizer, local launch) on the ``synthetic``
task, whose fit is a seeded perturbation of the state, so the round's cost
is what the mesh does with the model, not training. The coordinator is
started through a small wrapper that records its own peak RSS
(``getrusage(RUSAGE_SELF).ru_maxrss``, the coordinator process only: the
workers are separate processes) when it exits; seconds per round are the
mean of the rounds' own clocks (``seconds`` in ``metrics.jsonl``).

Printed per cell and tree: peak RSS in MB and in model copies (peak RSS /
model bytes, the Python and numpy baseline included), the target (4 model
copies + 200 MB, issue 12), and seconds per round, each as the minimum over
``--repeat`` runs with the spread (max - min) beside it.

``--quantize BITS`` adds ``[compression] name = "quantize"`` with those bits
to every run (both trees): with one client a worker the round is the flat
compressed round (issue 37), whose coordinator decoded each payload whole
before this branch and sums it chunk by chunk after. With ``--baseline`` a
last line per cell gives this tree's figures over the baseline's (the ratio
of the minima), peak RSS and seconds per round.

``--baseline DIR`` runs the same cells with the checkout in DIR (its own
``DIR/.venv/bin/python``): the "today" column. The task is selected as
``meshkit_tasks.synthetic:SyntheticTask`` in both trees, so a tree from
before the synthetic task existed is given this tree's copy of
``plugins/meshkit_tasks/synthetic.py`` and ``options.py`` (the benchmark says
so when it copies them). This is a benchmark, not a test: it asserts
nothing, and its numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TASK = "meshkit_tasks.synthetic:SyntheticTask"

#: Runs ``meshkit run CONFIG`` in this process and writes its peak RSS (bytes) on exit.
WRAPPER = textwrap.dedent("""
    import atexit, resource, runpy, sys
    out = sys.argv.pop(1)
    def record():
        with open(out, "w") as fh:
            fh.write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
    atexit.register(record)
    sys.argv = ["meshkit", *sys.argv[1:]]
    runpy.run_module("meshkit", run_name="__main__")
""")

MB = 1 << 20


def config_text(out: Path, *, params: int, workers: int, rounds: int, window: int | None,
                retain: int | None, timeout: float, per_worker: int = 1,
                quantize: int | None = None) -> str:
    compression = (f'[compression]\n        name = "quantize"\n        bits = {quantize}'
                   if quantize is not None else "")
    window_line = f"window = {window}" if window is not None else ""
    clients_line = f"clients = {per_worker * workers}" if per_worker > 1 else ""
    retain_line = f"retain = {retain}" if retain is not None else ""
    return textwrap.dedent(f"""
        [run]
        task = "{TASK}"
        seed = 1
        out = "{out}"

        [mesh]
        launch = "local"
        workers = {workers}
        timeout = {timeout}
        join_timeout = 300

        [strategy]
        name = "federated"
        rounds = {rounds}
        {window_line}
        {clients_line}

        [task]
        params = {params}
        rows = {max(1024, per_worker * workers)}

        [aggregator]
        name = "fedavg"
        {retain_line}

        [outer_optimizer]
        name = "average"

        {compression}
    """)


def ensure_synthetic(tree: Path) -> None:
    """Give a tree from before the synthetic task this tree's copy of it."""
    target = tree / "plugins" / "meshkit_tasks"
    if (target / "synthetic.py").exists():
        return
    for name in ("synthetic.py", "options.py"):
        shutil.copy2(ROOT / "plugins" / "meshkit_tasks" / name, target / name)
    print(f"# copied plugins/meshkit_tasks/synthetic.py and options.py into {target}",
          flush=True)


def one_run(python: str, tree: Path, *, params: int, workers: int, rounds: int,
            window: int | None, retain: int | None, timeout: float,
            per_worker: int = 1, quantize: int | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="meshkit-round-memory-") as tmp:
        tmpdir = Path(tmp)
        out = tmpdir / "out"
        config = tmpdir / "run.toml"
        config.write_text(config_text(out, params=params, workers=workers, rounds=rounds,
                                      window=window, retain=retain, timeout=timeout,
                                      per_worker=per_worker, quantize=quantize))
        rss_file = tmpdir / "rss"
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MESHKIT_SECRET")}
        started = time.perf_counter()
        proc = subprocess.run([python, "-c", WRAPPER, str(rss_file), "run", str(config)],
                              cwd=tree, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - started
        if proc.returncode != 0:
            raise RuntimeError(f"meshkit run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
                if line]
        return {"rss": int(rss_file.read_text()),
                "seconds": statistics.mean(r["seconds"] for r in rows), "wall": wall,
                "answered": [r["answered"] for r in rows]}


def spread(values: list[float]) -> tuple[float, float]:
    return min(values), max(values) - min(values)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, nargs="*", default=None,
                        help="model sizes (float32 parameters); default: the issue's grid")
    parser.add_argument("--workers", type=int, nargs="*", default=None,
                        help="worker counts for every size (default: 10M at 2 4 8 16, "
                             "50M at 2 4)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--window", type=int, default=None,
                        help="[strategy] window (this tree only; default: the strategy's)")
    parser.add_argument("--retain", type=int, default=None,
                        help="[aggregator] retain of fedavg (this tree only; default: its own)")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--clients-per-worker", type=int, default=1,
                        help="[strategy] clients = this x workers (default 1: one client a "
                             "worker); 2 or more plays this tree's batched round (issue 22)")
    parser.add_argument("--quantize", type=int, choices=(8, 4, 2), default=None,
                        help="[compression] quantize with these bits, in both trees (one "
                             "client a worker: the flat compressed round, issue 37)")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a checkout of the pre-engine code (with DIR/.venv)")
    args = parser.parse_args(argv)

    if args.params is None and args.workers is None:
        grid = [(10_000_000, w) for w in (2, 4, 8, 16)] + [(50_000_000, w) for w in (2, 4)]
    else:
        sizes = [int(p) for p in (args.params or [10_000_000])]
        grid = [(p, w) for p in sizes for w in (args.workers or [2, 4, 8, 16])]
    trees = [("engine", sys.executable, ROOT, args.window, args.retain)]
    if args.baseline is not None:
        base = args.baseline.resolve()
        ensure_synthetic(base)
        trees.append(("today", str(base / ".venv" / "bin" / "python"), base, None, None))

    print(f"# {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; "
          f"{args.rounds} rounds, {args.repeat} repeats; min (spread) over repeats"
          + (f"; [compression] quantize {args.quantize} bits" if args.quantize else ""),
          flush=True)
    print(f"{'params':>10} {'workers':>7} {'tree':>7} {'peak RSS MB':>16} {'copies':>14} "
          f"{'target MB':>9} {'met':>4} {'s/round':>14}", flush=True)
    for params, workers in grid:
        model = params * 4
        target = 4 * model + 200 * MB
        # Trees take turns, repeat by repeat, so a change in the machine's load
        # (it is shared) falls on both alike.
        runs: dict[str, list[dict[str, Any]]] = {label: [] for label, *_ in trees}
        for _ in range(args.repeat):
            for label, python, tree, window, retain in trees:
                runs[label].append(one_run(python, tree, params=params, workers=workers,
                                           rounds=args.rounds, window=window, retain=retain,
                                           timeout=args.timeout,
                                           per_worker=args.clients_per_worker,
                                           quantize=args.quantize))
        for label, *_ in trees:
            rss, rss_spread = spread([r["rss"] for r in runs[label]])
            sec, sec_spread = spread([r["seconds"] for r in runs[label]])
            print(f"{params:>10} {workers:>7} {label:>7} "
                  f"{rss / MB:>9.0f} ({rss_spread / MB:>4.0f}) "
                  f"{rss / model:>7.2f} ({rss_spread / model:>4.2f}) "
                  f"{target / MB:>9.0f} {'yes' if rss <= target else 'no':>4} "
                  f"{sec:>7.3f} ({sec_spread:>5.3f})", flush=True)
        if len(trees) == 2:
            mine, base = runs[trees[0][0]], runs[trees[1][0]]
            rss_ratio = min(r["rss"] for r in mine) / min(r["rss"] for r in base)
            sec_ratio = min(r["seconds"] for r in mine) / min(r["seconds"] for r in base)
            pairs = [a["seconds"] / b["seconds"] for a, b in zip(mine, base)]
            print(f"{params:>10} {workers:>7} {'ratio':>7} peak RSS {rss_ratio:.2f}, "
                  f"s/round {sec_ratio:.2f} (repeat by repeat {min(pairs):.2f} to "
                  f"{max(pairs):.2f}); {trees[0][0]} / {trees[1][0]}", flush=True)
    print(f"# load average after: {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
