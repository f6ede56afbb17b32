"""A SecAgg+ round against the plain round it replaces, end to end, in one run (issue 36).

Run (from the repository root, in the dev venv)::

    python benchmarks/secure_round.py                        # n = 100, 100k parameters, 4 workers
    python benchmarks/secure_round.py --baseline before=/tmp/base-e98c367
    python benchmarks/secure_round.py --clients 20,50,100 --repeat 1   # a quick look

Each cell is a real ``meshkit run`` (local launch, coordinator and workers
as processes, authenticated and encrypted frames): ``federated`` on the
``synthetic`` task (``--params`` float32 parameters), every one of
``--clients`` clients each round, ``fedavg``, on ``--workers`` workers;
the plain round (the baseline) and the same run with
``[secure_aggregation]`` at its defaults (``degree = "auto"`` with the
cohort placed along the ring, ``interleave = true``: 8 at n = 100 over 4
workers, threshold 5 (50 and 26 in client order, before issue 36's
placement); the complete graph over 2; ``clip_range = 1``). The runs take turns
(plain, secure, each ``--baseline`` tree's secure round), ``--repeat``
times, so a change in the machine's load falls on all alike.

A baseline is ``LABEL=DIR``: a checkout of the code before, run with this
interpreter and ``PYTHONPATH=DIR:DIR/plugins`` (its modules, this venv's
libraries and entry point names), or ``LABEL=DIR:PYTHON`` for its own
interpreter.

Measured per run: the median of the rounds' own clocks (``seconds`` in
``metrics.jsonl``) after the first (which pays the connections' warm-up).
Printed: each cell's seconds per round (median over trials, min-max), and
the secure round's ratio to the plain round of the same trials (goal <= 5,
issue 36; the goal behind it 3), and to each baseline's. This is a
benchmark, not a test: it asserts nothing.
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

ROOT = Path(__file__).resolve().parents[1]


def config_text(out: Path, *, clients: int, workers: int, params: int, rounds: int,
                secure: bool) -> str:
    text = textwrap.dedent(f"""
        [run]
        task = "synthetic"
        seed = 0
        out = "{out}"

        [mesh]
        launch = "local"
        workers = {workers}
        timeout = 300
        join_timeout = 300

        [strategy]
        name = "federated"
        rounds = {rounds}
        clients = {clients}
        min_clients = {clients}

        [task]
        params = {params}
        rows = {max(1024, clients)}

        [aggregator]
        name = "fedavg"

        [outer_optimizer]
        name = "average"
    """)
    if secure:
        text += "\n[secure_aggregation]\nclip_range = 1.0\n"
    return text


def one_run(python: str, tree: Path, pythonpath: str | None, *, clients: int, workers: int,
            params: int, rounds: int, secure: bool) -> float:
    """Seconds per round of one ``meshkit run`` (median after the first round)."""
    with tempfile.TemporaryDirectory(prefix="meshkit-secure-round-") as tmp:
        out = Path(tmp) / "out"
        config = Path(tmp) / "run.toml"
        config.write_text(config_text(out, clients=clients, workers=workers, params=params,
                                      rounds=rounds, secure=secure))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MESHKIT_SECRET")}
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        proc = subprocess.run([python, "-m", "meshkit", "run", str(config)], cwd=tree, env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"meshkit run in {tree} failed ({proc.returncode}):\n"
                               f"{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
                if line]
        return statistics.median(r["seconds"] for r in rows[1:])


def parse_baseline(text: str) -> tuple[str, str, Path, str | None]:
    label, _, where = text.partition("=")
    if not label or not where:
        raise argparse.ArgumentTypeError(f"a baseline is LABEL=DIR[:PYTHON], got {text!r}")
    directory, _, python = where.partition(":")
    tree = Path(directory).resolve()
    if python:
        return label, python, tree, None
    return label, sys.executable, tree, f"{tree}{os.pathsep}{tree / 'plugins'}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="100", help="comma list of cohort sizes")
    parser.add_argument("--workers", type=int, default=4)  # degree "auto" is 8 at n = 100
    parser.add_argument("--params", type=float, default=1e5)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline", type=parse_baseline, action="append", default=[],
                        help="LABEL=DIR[:PYTHON], repeatable: that tree's secure round")
    args = parser.parse_args(argv)
    cohorts = [int(c) for c in args.clients.split(",") if c]
    params = int(args.params)
    # This tree by path too, so that a snapshot of it (a worktree) measures itself.
    here = f"{ROOT}{os.pathsep}{ROOT / 'plugins'}"
    runs: list[tuple[str, str, Path, str | None, bool]] = [
        ("plain", sys.executable, ROOT, here, False), ("secure", sys.executable, ROOT, here, True)]
    runs += [(f"secure@{label}", python, tree, path, True)
             for label, python, tree, path in args.baseline]
    print(f"# {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; {params:,} "
          f"parameters, {args.workers} workers, {args.rounds} rounds a run, {args.repeat} "
          f"trials; seconds per round, median (min-max) over trials", flush=True)
    results: dict[tuple[int, str], list[float]] = {
        (n, label): [] for n in cohorts for label, *_ in runs}
    for _ in range(args.repeat):
        for n in cohorts:
            for label, python, tree, path, secure in runs:
                results[n, label].append(one_run(
                    python, tree, path, clients=n, workers=args.workers, params=params,
                    rounds=args.rounds, secure=secure))
    print(f"# load average at the end {os.getloadavg()[0]:.2f}", flush=True)
    for n in cohorts:
        plain = statistics.median(results[n, "plain"])
        for label, *_ in runs:
            values = results[n, label]
            mid = statistics.median(values)
            paired = [s / p for s, p in zip(values, results[n, "plain"])]
            ratio = "" if label == "plain" else (
                f"  {mid / plain:5.2f}x plain (per trial {min(paired):.2f}-{max(paired):.2f})")
            if label == "secure":
                ratio += "".join(
                    f", {mid / statistics.median(results[n, other]):.2f}x {other}"
                    for other, *_ in runs if other.startswith("secure@"))
            print(f"n = {n:>4} {label:>16} {mid:8.3f} s ({min(values):.3f}-{max(values):.3f})"
                  f"{ratio}", flush=True)


if __name__ == "__main__":
    main()
