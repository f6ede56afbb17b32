"""A large model through a federated round: coordinator peak memory and transfer rate (issue 39).

Run (from the repository root, in the dev venv)::

    python benchmarks/large_model.py                                  # 100M float32 (400 MB)
    python benchmarks/large_model.py --params 500e6 --repeat 1        # the issue's 2 GB model
    python benchmarks/large_model.py --baseline main-e42316d=/tmp/base-e42316d

Each trial is a real ``meshkit run`` (local launch, ``workers`` worker
processes, one client each, ``fedavg``, ``average`` outer optimizer) on the
``synthetic`` task, whose fit is the state plus seeded noise: what a round
costs is what the mesh does with the model (plus drawing ``params`` normal
numbers per fit). The coordinator runs through ``round_memory.py``'s
wrapper, which records its own peak RSS (``ru_maxrss``; the workers are
other processes). ``[mesh] segment_bytes`` is left at its default unless
``--segment-bytes`` is given (a baseline from before segments gets none).

Beside each trial, in the same run, one raw loopback TCP stream: ``params
* 4`` bytes sent through a connected socket pair by one thread and read by
another, ``--raw`` times (median): the bandwidth a single TCP stream gets on
this machine at that moment. A round moves the model ``2 * workers`` times
through the coordinator (the state out to each worker, a contribution back
from each), so its *transfer rate* is ``2 * workers * model / seconds per
round`` (the rounds after the first, their own clocks in ``metrics.jsonl``),
a lower bound: the round's seconds include the workers' fits and the fold.

Printed per tree: peak RSS in MB and in model copies, seconds per round and
transfer rate, each as the median over ``--repeat`` trials with min-max,
the raw stream's rate, and the ratio (round rate / raw rate). This is a
benchmark, not a test: it asserts nothing, and its numbers depend on the
machine and its load (the load average is printed with them).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from round_memory import MB, WRAPPER, ensure_synthetic

ROOT = Path(__file__).resolve().parents[1]
TASK = "meshkit_tasks.synthetic:SyntheticTask"


def config_text(out: Path, *, params: int, workers: int, rounds: int, timeout: float,
                segment_bytes: int | None) -> str:
    segment = f"segment_bytes = {segment_bytes}" if segment_bytes else ""
    return textwrap.dedent(f"""
        [run]
        task = "{TASK}"
        seed = 1
        out = "{out}"

        [mesh]
        launch = "local"
        workers = {workers}
        timeout = {timeout}
        join_timeout = 600
        {segment}

        [strategy]
        name = "federated"
        rounds = {rounds}

        [task]
        params = {params}
        rows = 1024

        [aggregator]
        name = "fedavg"

        [outer_optimizer]
        name = "average"
    """)


def one_run(python: str, tree: Path, *, params: int, workers: int, rounds: int,
            timeout: float, segment_bytes: int | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="meshkit-large-model-") as tmp:
        tmpdir = Path(tmp)
        out = tmpdir / "out"
        config = tmpdir / "run.toml"
        config.write_text(config_text(out, params=params, workers=workers, rounds=rounds,
                                      timeout=timeout, segment_bytes=segment_bytes))
        rss_file = tmpdir / "rss"
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MESHKIT_SECRET")}
        proc = subprocess.run([python, "-c", WRAPPER, str(rss_file), "run", str(config)],
                              cwd=tree, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"meshkit run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
                if line]
        later = [r["seconds"] for r in rows[1:]] or [rows[0]["seconds"]]
        return {"rss": int(rss_file.read_text()), "seconds": statistics.median(later)}


def raw_stream(nbytes: int) -> float:
    """Bytes per second of one loopback TCP stream carrying ``nbytes`` (one sender, one reader)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        dialer = socket.create_connection(listener.getsockname())
        reader, _ = listener.accept()
    chunk = memoryview(bytearray(4 << 20))
    sink = bytearray(4 << 20)

    def send() -> None:
        left = nbytes
        while left:
            n = dialer.send(chunk[:min(left, len(chunk))])
            left -= n
        dialer.shutdown(socket.SHUT_WR)

    started = time.perf_counter()
    sender = threading.Thread(target=send)
    sender.start()
    got = 0
    while True:
        n = reader.recv_into(sink)
        if not n:
            break
        got += n
    elapsed = time.perf_counter() - started
    sender.join()
    dialer.close(), reader.close()
    assert got == nbytes
    return nbytes / elapsed


def parse_baseline(text: str) -> tuple[str, Path, str]:
    label, _, where = text.partition("=")
    if not where:
        raise argparse.ArgumentTypeError(f"--baseline LABEL=DIR[:PYTHON], got {text!r}")
    directory, _, python = where.partition(":")
    tree = Path(directory).resolve()
    return label, tree, python or str(tree / ".venv" / "bin" / "python")


def fmt(values: list[float], unit: str = "", scale: float = 1.0) -> str:
    scaled = [v / scale for v in values]
    return (f"{statistics.median(scaled):.2f}{unit} "
            f"({min(scaled):.2f}-{max(scaled):.2f})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100e6,
                        help="float32 parameters (default 100M: 400 MB; the issue asks 500M)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--raw", type=int, default=3, help="raw-stream trials per trial")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--segment-bytes", type=int, default=None)
    parser.add_argument("--baseline", type=parse_baseline, action="append", default=[],
                        metavar="LABEL=DIR[:PYTHON]")
    args = parser.parse_args(argv)
    params = int(args.params)
    model = params * 4
    trees = [("this", ROOT, sys.executable, args.segment_bytes),
             *[(label, tree, python, None) for label, tree, python in args.baseline]]
    for _, tree, _, _ in trees[1:]:
        ensure_synthetic(tree)
    results: dict[str, list[dict[str, Any]]] = {label: [] for label, *_ in trees}
    raws: list[float] = []
    print(f"# {params:,} float32 parameters ({model / MB:.0f} MB), {args.workers} workers, "
          f"{args.rounds} rounds, {args.repeat} trials; load {os.getloadavg()}", flush=True)
    for trial in range(args.repeat):
        for label, tree, python, segment in trees:  # the trees take turns, trial by trial
            raws.append(statistics.median(raw_stream(model) for _ in range(args.raw)))
            got = one_run(python, tree, params=params, workers=args.workers,
                          rounds=args.rounds, timeout=args.timeout, segment_bytes=segment)
            results[label].append(got)
            print(f"# trial {trial + 1} {label}: peak {got['rss'] / MB:.0f} MB, "
                  f"{got['seconds']:.2f} s/round, raw {raws[-1] / MB:.0f} MB/s; "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    raw = statistics.median(raws)
    print(f"\nraw loopback stream: {fmt(raws, ' MB/s', MB)}")
    print("| tree | peak RSS (MB) | model copies | s/round | round transfer (MB/s) | "
          "vs raw stream |")
    print("|---|---|---|---|---|---|")
    for label, *_ in trees:
        rows = results[label]
        rss = [r["rss"] for r in rows]
        rates = [2 * args.workers * model / r["seconds"] for r in rows]
        print(f"| {label} | {fmt(rss, '', MB)} | {fmt(rss, '', model)} | "
              f"{fmt([r['seconds'] for r in rows], '')} | {fmt(rates, '', MB)} | "
              f"{statistics.median(rates) / raw:.2f}x |")
    print(f"\nload average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
