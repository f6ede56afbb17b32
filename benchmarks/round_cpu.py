"""CPU a round costs across every process of a real run: this tree against baselines, interleaved (issue 36).

Run (from the repository root, in the dev venv)::

    python benchmarks/round_cpu.py --cells 3x3 \\
        --baseline turn2-669dbec=/work/wt/base669 --baseline main=/work/wt/basemain

Why. A flat 3-clients-on-3-workers round is ~5 ms of wall clock; on a
shared 2-core machine the same tree's median round moves by 10-50 % from
one run to the next (docs/benchmarks.md, issue 36), because a round's wall
clock counts every time slice the scheduler gives to somebody else. The CPU
the run's own processes spend is what this code costs; other processes only
reach it through caches and frequency, so it holds still under load where
the wall clock does not.

What. Each trial is a real ``meshkit run`` (:mod:`engine_cost`'s config:
``digits``, ``fedavg``, ``average``, local launch, every client every
round), started from the tree's directory with its own Python. While it
runs, this script watches ``metrics.jsonl`` (one flushed line a round, in
every tree since turn 2) and, once ``--warm`` rounds are done and again
when all but ``--tail`` are, reads ``utime + stime`` from ``/proc/PID/stat``
of the coordinator and every process below it (the workers; exited
threads included, so a pool made and dropped per round is counted). The
difference over the rounds finished in between is the run's **CPU per
round**: coordinator plus workers, with the checkpoint and the metrics
line each round writes, and without start-up, connection and teardown.
A sample is taken between two reads of the line count that agree, so the
rounds counted are the rounds paid for, give or take the one in flight at
each end (1 in ``--rounds``). ``/proc`` counts in clock ticks (10 ms);
the sum over ~1 s of CPU or more keeps that below 1 %.

The trees take turns, trial by trial, each in every place of the turn in
rotation (so use a ``--repeat`` that the number of trees divides), so the
machine's load and any place in the turn fall on all alike. Printed per tree: CPU ms per round, median over trials (min-max)
and its spread ((max - min) / median), split into coordinator and
workers; the wall clock of the same rounds (``seconds`` in
``metrics.jsonl``, median); the ratio to each baseline of the medians and
per trial (trial i of this tree against trial i of the baseline, taken one
after the other) and of the minimums (load only adds CPU time: caches and
the other core's traffic slow a process down, never speed it up, so the
least a tree took is its figure least disturbed); the load average before
and after. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_cost import ROOT, config_text, parse_baseline, parse_cell  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def children_of() -> dict[int, list[int]]:
    """Every process's children, from ``/proc/*/stat``'s parent field."""
    tree: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        tree.setdefault(int(fields[1]), []).append(int(entry.name))
    return tree


def descendants(root: int) -> list[int]:
    """``root`` and every process below it."""
    tree, out, todo = children_of(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(tree.get(pid, ()))
    return out


def ticks(pid: int) -> int | None:
    """``utime + stime`` of a process (all its threads, exited ones too), in clock ticks."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5)


class Lines:
    """How many complete lines ``metrics.jsonl`` has, read incrementally."""

    def __init__(self, path: Path) -> None:
        self.path, self.count, self._fh = path, 0, None

    def __call__(self) -> int:
        if self._fh is None:
            try:
                self._fh = open(self.path, "rb")
            except FileNotFoundError:
                return 0
        self.count += self._fh.read().count(b"\n")
        return self.count

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()


def sample(root: int, lines: Lines) -> tuple[int, dict[int, int]]:
    """The rounds done and every process's ticks, taken between two equal line counts."""
    for _ in range(50):
        before = lines()
        counts = {pid: t for pid in descendants(root) if (t := ticks(pid)) is not None}
        if lines() == before:
            return before, counts
    raise RuntimeError("metrics.jsonl kept growing while sampling (50 tries)")


def one_trial(python: str, tree: Path, *, clients: int, workers: int, rounds: int,
              warm: int, tail: int, poll: float, limit: float) -> dict[str, Any]:
    """One ``meshkit run``: CPU per round (s) between round ``warm`` and ``rounds - tail``."""
    with tempfile.TemporaryDirectory(prefix="meshkit-round-cpu-") as tmp:
        out = Path(tmp) / "out"
        config = Path(tmp) / "run.toml"
        config.write_text(config_text(out, clients=clients, workers=workers, rounds=rounds,
                                      flat=False))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MESHKIT_SECRET")}
        lines = Lines(out / "metrics.jsonl")
        with open(Path(tmp) / "stderr", "wb") as err:
            proc = subprocess.Popen([python, "-m", "meshkit", "run", str(config)], cwd=tree,
                                    env=env, stdout=subprocess.DEVNULL, stderr=err)
            marks: list[tuple[int, dict[int, int], float]] = []
            deadline = time.monotonic() + limit
            try:
                for target in (warm, rounds - tail):
                    while lines() < target:
                        if proc.poll() is not None:
                            break
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"{tree}: no round {target} in {limit:g} s")
                        time.sleep(poll)
                    else:
                        done, counts = sample(proc.pid, lines)
                        marks.append((done, counts, time.monotonic()))
                        continue
                    break
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            finally:
                lines.close()
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if proc.returncode != 0 or len(marks) != 2:
            raise RuntimeError(f"meshkit run in {tree} failed ({proc.returncode}):\n"
                               f"{(Path(tmp) / 'stderr').read_text()[-3000:]}")
        (n0, a, t0), (n1, b, t1) = marks
        gone = set(a) - set(b)
        if gone:
            raise RuntimeError(f"{tree}: processes {sorted(gone)} ended inside the window")
        spent = {pid: b[pid] - a.get(pid, 0) for pid in b}
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
                if line]
        served = {len(r["served"]) for r in rows if "served" in r} or {clients}
        if served != {clients}:
            raise RuntimeError(f"{tree}: rounds served {sorted(served)} clients, not {clients}")
        n = n1 - n0
        return {"cpu": sum(spent.values()) / TICK / n,
                "coordinator": spent[proc.pid] / TICK / n,
                "workers": (sum(spent.values()) - spent[proc.pid]) / TICK / n,
                "processes": len(b), "rounds": n, "window": (t1 - t0) / n,
                "wall": statistics.median(r["seconds"] for r in rows[n0:n1])}


def spread(values: list[float]) -> str:
    mid = statistics.median(values)
    return (f"{mid * 1e3:7.3f} ({min(values) * 1e3:.3f}-{max(values) * 1e3:.3f}, "
            f"spread {(max(values) - min(values)) / mid:.0%})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", type=parse_cell, nargs="*", default=[(3, 3)],
                        help="CLIENTSxWORKERS (default: 3x3)")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--warm", type=int, default=5,
                        help="rounds done before the window opens (default 5)")
    parser.add_argument("--tail", type=int, default=3,
                        help="rounds left when the window closes (default 3)")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--poll", type=float, default=0.002, help="seconds between looks")
    parser.add_argument("--limit", type=float, default=900.0, help="seconds a run may take")
    parser.add_argument("--baseline", type=parse_baseline, action="append", default=[],
                        help="LABEL=DIR[:PYTHON], repeatable")
    args = parser.parse_args(argv)
    if args.rounds - args.tail <= args.warm:
        parser.error("--rounds must exceed --warm + --tail")
    trees = [("this", sys.executable, ROOT)] + list(args.baseline)
    print(f"# {os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
          f"; {args.rounds} rounds a run, window rounds {args.warm}-{args.rounds - args.tail}, "
          f"{args.repeat} trials, trees taking turns; CPU is utime+stime of the coordinator "
          f"and every process below it; ms per round, median (min-max) over trials",
          flush=True)
    for label, python, tree in trees:
        print(f"# {label}: {tree} ({python})", flush=True)
    results: dict[tuple[int, int], dict[str, list[dict[str, Any]]]] = {
        cell: {label: [] for label, *_ in trees} for cell in args.cells}
    for trial in range(args.repeat):
        # Each tree takes each place in the turn in rotation: a fixed order gave the
        # first tree a place of its own (identical code measured 0.86x of itself there).
        turn = trees[trial % len(trees):] + trees[:trial % len(trees)]
        for cell in args.cells:
            for label, python, tree in turn:
                r = one_trial(python, tree, clients=cell[0], workers=cell[1],
                              rounds=args.rounds, warm=args.warm, tail=args.tail,
                              poll=args.poll, limit=args.limit)
                results[cell][label].append(r)
                print(f"#   trial {trial + 1} {cell[0]}x{cell[1]} {label:>14}: cpu "
                      f"{r['cpu'] * 1e3:.3f} ms/round (coordinator {r['coordinator'] * 1e3:.3f}, "
                      f"{r['processes'] - 1} below it {r['workers'] * 1e3:.3f}), wall "
                      f"{r['wall'] * 1e3:.2f} ms/round, {r['rounds']} rounds, load "
                      f"{os.getloadavg()[0]:.2f}", flush=True)
    for cell in args.cells:
        print(f"## {cell[0]} clients on {cell[1]} workers", flush=True)
        for label, *_ in trees:
            rs = results[cell][label]
            print(f"{label:>14}  cpu {spread([r['cpu'] for r in rs])}  coordinator "
                  f"{spread([r['coordinator'] for r in rs])}  workers "
                  f"{spread([r['workers'] for r in rs])}  wall "
                  f"{spread([r['wall'] for r in rs])}", flush=True)
        mine = results[cell]["this"]
        for label, *_ in trees[1:]:
            theirs = results[cell][label]
            for key in ("cpu", "coordinator", "workers", "wall"):
                pairs = [m[key] / t[key] for m, t in zip(mine, theirs)]
                whole = (statistics.median(m[key] for m in mine)
                         / statistics.median(t[key] for t in theirs))
                least = min(m[key] for m in mine) / min(t[key] for t in theirs)
                print(f"  this / {label} {key:>11}: {whole:.3f} (per trial median "
                      f"{statistics.median(pairs):.3f}, {min(pairs):.3f}-{max(pairs):.3f}; "
                      f"of the minimums {least:.3f})", flush=True)
    print(f"# load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)


if __name__ == "__main__":
    main()
