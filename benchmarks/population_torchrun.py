"""Client updates per second of one federated job under torchrun (``mode = "spmd"``) at 1, 2, 4 ranks.

Run (from the repository root, torch installed: ``pip install torch==2.13.0``)::

    python benchmarks/population_torchrun.py                    # 200 clients, 50 a round
    python benchmarks/population_torchrun.py --rounds 10 --ranks 1 2
    python benchmarks/population_torchrun.py --task synthetic-federated --clients 100000 \
        --per-round 100                                         # a population of 100,000

The same job three ways, in one run, one after another:

* **baseline**: ``meshkit run`` of the job on the tcp star with ``[mesh]
  workers`` (default 2) local worker processes (the round engine: the
  coordinator hands out clients and folds them);
* **spmd at K ranks**: ``torchrun --standalone --nproc-per-node K -m
  meshkit_torchdist`` with ``[transport] mode = "spmd"``: every rank fits
  its slice of the cohort and one int64 all-reduce a round combines them.

A round's time is its ``seconds`` in ``metrics.jsonl`` (the round's fits,
fold, outer step and evaluation; not the processes' start-up); round 1 is
left out (warm-up). Client updates per second = clients a round / median
round seconds. Prints each row and its ratio to the baseline, and checks
that every spmd run ends on the same model bits as the 1-rank one. A
measurement, not a test: on a shared machine its figures move with the load.
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

import numpy as np

from meshkit.checkpoint import load_checkpoint


def _config(path: Path, out: Path, args: argparse.Namespace, *, spmd: bool) -> Path:
    # A population task says how many clients it has ([task] clients); a data set is
    # split into [strategy] clients.
    population = args.task == "synthetic-federated"
    task_table = f"[task]\nclients = {args.clients}" if population else ""
    clients = "" if population else f"clients = {args.clients}"
    path.write_text(textwrap.dedent(f"""
        [run]
        task = "{args.task}"
        seed = 1
        out = "{out}"

        [mesh]
        transport = "{'torchdist' if spmd else 'tcp'}"
        workers = {args.workers}
        timeout = 60
        {'[transport]' if spmd else ''}
        {'mode = "spmd"' if spmd else ''}

        [strategy]
        name = "federated"
        rounds = {args.rounds}
        {clients}
        fraction = {args.per_round / args.clients}

        [aggregator]
        name = "fedavg"
    """) + task_table + "\n")
    return path


def _round_seconds(out: Path) -> list[float]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    return [float(x["seconds"]) for x in lines[1:]]


def _run(command: list[str], cwd: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MESHKIT_SECRET", None)
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="digits")
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--per-round", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2, help="the baseline's worker processes")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="meshkit-spmd-bench-"))
    rows: list[tuple[str, list[float]]] = []
    star = work / "star"
    _run([sys.executable, "-m", "meshkit", "run",
          str(_config(work / "star.toml", star, args, spmd=False))], work)
    rows.append((f"meshkit run, {args.workers} workers (baseline)", _round_seconds(star)))
    models = {}
    for ranks in args.ranks:
        out = work / f"spmd{ranks}"
        _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
              "--nproc-per-node", str(ranks), "-m", "meshkit_torchdist",
              str(_config(work / f"spmd{ranks}.toml", out, args, spmd=True))], work)
        rows.append((f"torchrun spmd, {ranks} rank(s)", _round_seconds(out)))
        models[ranks] = load_checkpoint(out).state
    base = statistics.median(rows[0][1])
    print(f"{args.task}: {args.clients} clients, {args.per_round} a round, "
          f"{args.rounds} rounds (round 1 left out); load {os.getloadavg()[0]:.1f}")
    print(f"{'run':38s} {'s/round median':>15s} {'(min-max)':>17s} {'updates/s':>10s} "
          f"{'vs baseline':>12s}")
    for name, seconds in rows:
        median = statistics.median(seconds)
        print(f"{name:38s} {median:15.4f} ({min(seconds):.4f}-{max(seconds):.4f}) "
              f"{args.per_round / median:10.0f} {base / median:11.2f}x")
    first = models[args.ranks[0]]
    same = all(all(np.array_equal(m[k], first[k]) for k in first) for m in models.values())
    print(f"spmd models bit-identical across {args.ranks} rank(s): {same}")


if __name__ == "__main__":
    main()
