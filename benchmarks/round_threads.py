"""CPU and context switches a round, thread by thread, in every process of a real run (issue 36).

Run (from the repository root, in the dev venv)::

    python benchmarks/round_threads.py --repeat 3 --baseline turn2-669dbec=/work/wt/base669

Why. :mod:`round_cpu` sums ``utime + stime`` over whole processes; it
cannot say *which* thread a round's CPU is in, nor how often threads hand
work to each other. On a 2-core VM a hand-off (a futex wake of a thread
waiting on the other vCPU) costs both sides CPU that no per-call profile
shows, and a thread that never sleeps (an OpenBLAS pool thread spinning
after a product, branch flat6) shows as CPU in a process whose calls are
all accounted for. This reads, for each thread of the coordinator and of
every process below it, ``utime + stime`` (``/proc/PID/task/TID/stat``)
and the voluntary and involuntary context switches
(``/proc/PID/task/TID/status``) once ``--warm`` rounds are done and again
when all but ``--tail`` are, the way :mod:`round_cpu` does (same config,
same window, the trees taking turns), and prints per round, median over
trials: the coordinator's main thread, its other threads together, the
workers' main threads together and their other threads together, with the
thread counts. Threads that start and end inside the window are not seen
(:mod:`round_cpu`'s process totals count them). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_cost import ROOT, config_text, parse_baseline  # noqa: E402
from round_cpu import TICK, Lines, descendants  # noqa: E402

#: (CPU ticks, voluntary switches, involuntary switches) of one thread.
Reading = tuple[int, int, int]


def threads(pid: int) -> dict[int, Reading]:
    """Every live thread of ``pid`` and its reading."""
    out: dict[int, Reading] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{pid}/task/{tid}/status", "rb") as fh:
                status = dict(line.split(b":", 1) for line in fh.read().splitlines()
                              if b":" in line)
        except OSError:  # ended meanwhile
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12]),
                         int(status[b"voluntary_ctxt_switches"]),
                         int(status[b"nonvoluntary_ctxt_switches"]))
    return out


def sample(root: int, lines: Lines) -> tuple[int, dict[int, dict[int, Reading]]]:
    for _ in range(50):
        before = lines()
        seen = {pid: threads(pid) for pid in descendants(root)}
        if lines() == before:
            return before, seen
    raise RuntimeError("metrics.jsonl kept growing while sampling (50 tries)")


GROUPS = ("coordinator main", "coordinator other", "workers main", "workers other")


def one_trial(python: str, tree: Path, *, clients: int, workers: int, rounds: int,
              warm: int, tail: int) -> dict[str, list[float]]:
    """Per group: [CPU ms, voluntary, involuntary] a round and the thread count."""
    with tempfile.TemporaryDirectory(prefix="meshkit-round-threads-") as tmp:
        out, config = Path(tmp) / "out", Path(tmp) / "run.toml"
        config.write_text(config_text(out, clients=clients, workers=workers, rounds=rounds,
                                      flat=False))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MESHKIT_SECRET")}
        lines = Lines(out / "metrics.jsonl")
        proc = subprocess.Popen([python, "-m", "meshkit", "run", str(config)], cwd=tree,
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        marks = []
        try:
            for target in (warm, rounds - tail):
                while lines() < target:
                    if proc.poll() is not None:
                        raise RuntimeError(f"meshkit run in {tree} ended ({proc.returncode})")
                    time.sleep(0.002)
                marks.append(sample(proc.pid, lines))
            proc.wait(timeout=600)
        finally:
            lines.close()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    (n0, a), (n1, b) = marks
    n = n1 - n0
    result = {group: [0.0, 0.0, 0.0, 0.0] for group in GROUPS}
    for pid, seen in b.items():
        for tid, (cpu, vol, inv) in seen.items():
            cpu0, vol0, inv0 = a.get(pid, {}).get(tid, (0, 0, 0))
            group = (("coordinator " if pid == proc.pid else "workers ")
                     + ("main" if tid == pid else "other"))
            row = result[group]
            row[0] += (cpu - cpu0) / TICK / n * 1e3
            row[1] += (vol - vol0) / n
            row[2] += (inv - inv0) / n
            row[3] += 1
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--warm", type=int, default=20)
    parser.add_argument("--tail", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline", type=parse_baseline, action="append", default=[],
                        help="LABEL=DIR[:PYTHON], repeatable")
    args = parser.parse_args(argv)
    trees = [("this", sys.executable, ROOT)] + list(args.baseline)
    print(f"# load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"{args.clients} clients on {args.workers} workers, window rounds "
          f"{args.warm}-{args.rounds - args.tail}, {args.repeat} trials, trees taking turns",
          flush=True)
    results: dict[str, list[dict[str, list[float]]]] = {label: [] for label, *_ in trees}
    for trial in range(args.repeat):
        for label, python, tree in trees:
            results[label].append(one_trial(python, tree, clients=args.clients,
                                            workers=args.workers, rounds=args.rounds,
                                            warm=args.warm, tail=args.tail))
            print(f"#   trial {trial + 1} {label} done, load {os.getloadavg()[0]:.2f}", flush=True)
    print("per round, median over trials: CPU ms / voluntary / involuntary switches "
          "(threads)", flush=True)
    for label, *_ in trees:
        cells = []
        for group in GROUPS:
            rows: list[Any] = [r[group] for r in results[label]]
            cells.append(f"{group} {statistics.median(r[0] for r in rows):.2f} / "
                         f"{statistics.median(r[1] for r in rows):.1f} / "
                         f"{statistics.median(r[2] for r in rows):.1f} ({int(rows[0][3])})")
        print(f"{label:>14}  " + "  ".join(cells), flush=True)
    print(f"# load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)


if __name__ == "__main__":
    main()
