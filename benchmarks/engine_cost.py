"""Per-client cost of a federated round: this tree against the code before, in one run (issue 22).

Run (from the repository root, in the dev venv)::

    python benchmarks/engine_cost.py \\
        --baseline main-caa2b2c=/tmp/base-caa2b2c --baseline pre-engine=/tmp/base-8be450d
    python benchmarks/engine_cost.py --cells 50x2 --rounds 4 --repeat 1   # a quick look

Each cell is a real ``meshkit run`` (local launch, a subprocess per tree
started from that tree's directory with its own Python, so modules and
entry points come from that tree): a federated job on ``digits`` (the
shipped 1,797 rows cut into ``clients`` contiguous shards, every client
each round, ``fedavg``, ``average`` outer optimizer) with ``workers``
workers. The cells are the issue's: 200 clients on 2 workers, 50 on 2, 3
on 3.

A baseline is ``LABEL=DIR`` (a checkout, run with ``DIR/.venv/bin/python``,
or ``LABEL=DIR:PYTHON``). The trees take turns, trial by trial and cell by
cell, so a change in the machine's load (it is shared) falls on all alike.
``--flat`` adds this tree with ``[strategy] round_timeout = 3600``, which
plays the flat (per-client) engine: the batched round's own share of the
change, in the same run. ``--window N`` (repeatable) adds this tree with
``[strategy] window = N``. ``--round-timeout SECONDS`` runs every tree,
baselines too, with ``[strategy] round_timeout = SECONDS``: the flat round
with a deadline against the code before, in the same run.

Measured per trial: the median of the rounds' own clocks (``seconds`` in
``metrics.jsonl``) over the rounds after the first (the first pays the
connection warm-up). Printed per cell and tree: seconds per round (median
over trials, with min-max), milliseconds per client (seconds per round /
clients), and the ratio to each baseline (< 1: this tree is faster). With
the 50- and 200-client cells, also the marginal cost of a client: the
slope (t200 - t50) / 150, which leaves out what a round costs whatever its
client count.

``--secure`` runs every tree's rounds under ``[secure_aggregation]``
(secagg+, its defaults but ``clip_range = 1.0``): the secure round against
the code before, in the same run.

``--in-process`` measures the engine's own cost per client instead, without
processes or the wire: the round engine over in-process workers
(``LocalPool``) on ``digits`` with 200 clients on 2 workers, batched and
flat (``fold_round(..., batch=False)``), minus the same 200 fits run alone
(best of 5 each). This is a benchmark, not a test: it asserts nothing, and
its numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def config_text(out: Path, *, clients: int, workers: int, rounds: int, flat: bool,
                round_timeout: float | None = None, secure: bool = False,
                window: int | None = None, encrypt: bool = True) -> str:
    if round_timeout is None and flat:
        round_timeout = 3600
    deadline = f"round_timeout = {round_timeout:g}" if round_timeout is not None else ""
    if window is not None:
        deadline += f"\n        window = {window}"
    return textwrap.dedent(f"""
        [run]
        task = "digits"
        seed = 1
        out = "{out}"

        [mesh]
        launch = "local"
        workers = {workers}
        timeout = 120
        join_timeout = 300
        {"" if encrypt else "encrypt = false"}

        [strategy]
        name = "federated"
        rounds = {rounds}
        clients = {clients}
        min_clients = {clients}
        {deadline}

        [aggregator]
        name = "fedavg"

        [outer_optimizer]
        name = "average"
    """) + (SECURE if secure else "")


#: ``--secure``: every tree's rounds under the built-in secure aggregation (the
#: defaults but for the clip range, so digits' updates are not clipped away).
SECURE = """
[secure_aggregation]
clip_range = 1.0
"""


def one_run(python: str, tree: Path, *, clients: int, workers: int, rounds: int,
            flat: bool, round_timeout: float | None = None, secure: bool = False,
            window: int | None = None) -> float:
    """Seconds per round of one ``meshkit run`` (median after the first round)."""
    with tempfile.TemporaryDirectory(prefix="meshkit-engine-cost-") as tmp:
        out = Path(tmp) / "out"
        config = Path(tmp) / "run.toml"
        config.write_text(config_text(out, clients=clients, workers=workers, rounds=rounds,
                                      flat=flat, round_timeout=round_timeout,
                                      secure=secure, window=window))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MESHKIT_SECRET")}
        proc = subprocess.run([python, "-m", "meshkit", "run", str(config)], cwd=tree, env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"meshkit run in {tree} failed ({proc.returncode}):\n"
                               f"{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
                if line]
        # (The code before the one round engine reports no "served".)
        served = {len(r["served"]) for r in rows if "served" in r} or {clients}
        if served != {clients}:
            raise RuntimeError(f"{tree}: rounds served {sorted(served)} clients, not {clients}")
        return statistics.median(r["seconds"] for r in rows[1:])


def in_process(clients: int = 200, workers: int = 2, repeat: int = 5) -> None:
    """The engine's own cost per client, batched and flat (module docstring)."""
    import time

    import numpy as np

    import meshkit.plugins
    from meshkit.train import LocalPool, StrategyContext, Work, client_seed, fold_round

    def task() -> Any:
        return meshkit.plugins.create("task", "digits", {})

    ranks = list(range(1, workers + 1))
    ctx = StrategyContext(task=task(), aggregator=meshkit.plugins.create("aggregator", "fedavg"),
                          pool=LocalPool.of(task, ranks), workers=ranks,
                          rng=np.random.default_rng(0), timeout=60.0)
    state = ctx.task.init_state(0)
    work = [Work(c, {"op": "fit", "shard": c, "shards": clients, "seed": client_seed(1, 1, c)})
            for c in range(clients)]
    alone = task()
    x, y = alone.train_data()
    bounds = np.linspace(0, len(y), clients + 1).astype(int)  # any cut: only the fits' cost

    def fits() -> None:
        for c in range(clients):
            alone.fit(state, x[bounds[c]:bounds[c + 1]], y[bounds[c]:bounds[c + 1]],
                      seed=client_seed(1, 1, c))

    def best(run: Any) -> float:
        run()  # warm-up
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return min(times)

    batched = best(lambda: fold_round(ctx, work, state=state))
    flat = best(lambda: fold_round(ctx, work, state=state, batch=False))
    only = best(fits)
    print(f"# in-process, digits, {clients} clients on {workers} workers, best of {repeat}: "
          f"batched {batched * 1e3:.1f} ms, flat {flat * 1e3:.1f} ms, the fits alone "
          f"{only * 1e3:.1f} ms", flush=True)
    print(f"# the engine's own cost per client: batched {(batched - only) / clients * 1e3:.3f} "
          f"ms, flat {(flat - only) / clients * 1e3:.3f} ms", flush=True)


def parse_baseline(text: str) -> tuple[str, str, Path]:
    label, _, where = text.partition("=")
    if not label or not where:
        raise argparse.ArgumentTypeError(f"a baseline is LABEL=DIR[:PYTHON], got {text!r}")
    directory, _, python = where.partition(":")
    tree = Path(directory).resolve()
    return label, python or str(tree / ".venv" / "bin" / "python"), tree


def parse_cell(text: str) -> tuple[int, int]:
    clients, _, workers = text.partition("x")
    return int(clients), int(workers)


def two_runs_parser(doc: str, *, short: int, long: int, keep: str) -> argparse.ArgumentParser:
    """The arguments of a benchmark that takes each tree's per-round figure from a short
    and a long run (``round_calls``, ``round_instructions``): the cells, both lengths, the
    baselines and ``--keep`` (``keep``: what is kept). Parse with :func:`parse_two_runs`."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--keep", type=Path, default=None, help=keep)
    parser.add_argument("--cells", type=parse_cell, nargs="*", default=[(3, 3)],
                        help="CLIENTSxWORKERS (default: 3x3)")
    parser.add_argument("--short", type=int, default=short, help="rounds of the short run")
    parser.add_argument("--long", type=int, default=long, help="rounds of the long run")
    parser.add_argument("--baseline", type=parse_baseline, action="append", default=[],
                        help="LABEL=DIR[:PYTHON], repeatable")
    return parser


def parse_two_runs(parser: argparse.ArgumentParser,
                   argv: list[str] | None) -> argparse.Namespace:
    """``parser``'s arguments (:func:`two_runs_parser`), the long run longer than the short."""
    args = parser.parse_args(argv)
    if args.long <= args.short:
        parser.error("--long must exceed --short")
    return args


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", type=parse_cell, nargs="*",
                        default=[(200, 2), (50, 2), (3, 3)],
                        help="CLIENTSxWORKERS (default: 200x2 50x2 3x3)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline", type=parse_baseline, action="append", default=[],
                        help="LABEL=DIR[:PYTHON], repeatable")
    parser.add_argument("--flat", action="store_true",
                        help="also this tree on the flat engine (round_timeout = 3600)")
    parser.add_argument("--round-timeout", type=float, default=None, metavar="SECONDS",
                        help="every tree with [strategy] round_timeout = SECONDS (the flat "
                             "round with a deadline, baselines too)")
    parser.add_argument("--window", type=int, action="append", default=[], metavar="N",
                        help="also this tree with [strategy] window = N (repeatable)")
    parser.add_argument("--secure", action="store_true",
                        help="every tree's rounds under [secure_aggregation] (secagg+)")
    parser.add_argument("--in-process", action="store_true",
                        help="the engine's own cost per client, no processes (docstring)")
    args = parser.parse_args(argv)
    if args.in_process:
        in_process()
        return

    trees: list[tuple[str, str, Path, bool, int | None]] = [
        ("this", sys.executable, ROOT, False, None)]
    if args.flat:
        trees.append(("this-flat", sys.executable, ROOT, True, None))
    trees += [(f"this-window-{n}", sys.executable, ROOT, False, n) for n in args.window]
    trees += [(label, python, tree, False, None) for label, python, tree in args.baseline]
    print(f"# {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; "
          f"{args.rounds} rounds a run, {args.repeat} trials; median (min-max) over trials"
          + (f"; every tree with round_timeout = {args.round_timeout:g}"
             if args.round_timeout is not None else "")
          + ("; every round secure (secagg+)" if args.secure else ""),
          flush=True)
    for label, python, tree, flat, _ in trees:
        print(f"# {label}: {tree} ({python}){' flat' if flat else ''}", flush=True)
    results: dict[tuple[int, int], dict[str, list[float]]] = {
        cell: {label: [] for label, *_ in trees} for cell in args.cells}
    for _ in range(args.repeat):
        for cell in args.cells:
            for label, python, tree, flat, window in trees:
                results[cell][label].append(one_run(python, tree, clients=cell[0],
                                                    workers=cell[1], rounds=args.rounds,
                                                    flat=flat,
                                                    round_timeout=args.round_timeout,
                                                    secure=args.secure, window=window))
    print(f"{'clients':>7} {'workers':>7} {'tree':>14} {'s/round':>22} {'ms/client':>9}  "
          f"ratios", flush=True)
    median: dict[tuple[int, int], dict[str, float]] = {}
    for cell in args.cells:
        median[cell] = {label: statistics.median(v) for label, v in results[cell].items()}
        for label, *_ in trees:
            values = results[cell][label]
            ratios = "  ".join(f"/{other} {median[cell][label] / median[cell][other]:.2f}"
                               for other, *_ in trees if other != label and label == "this")
            print(f"{cell[0]:>7} {cell[1]:>7} {label:>14} {median[cell][label]:>8.4f} "
                  f"({min(values):.4f}-{max(values):.4f}) "
                  f"{1000 * median[cell][label] / cell[0]:>9.3f}  {ratios}", flush=True)
    big, small = (200, 2), (50, 2)
    if big in median and small in median:
        for label, *_ in trees:
            slope = (median[big][label] - median[small][label]) / (big[0] - small[0])
            print(f"# marginal cost of a client on 2 workers, {label}: {1000 * slope:.3f} ms",
                  flush=True)
    print(f"# load average after: {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
