"""Scaling out: the flat star against host relays, by rank count (issue 16).

Run (from the repository root, in the dev venv)::

    python benchmarks/scale.py                                  # 4, 8, 16 ranks; 0, 2, 4 relays
    python benchmarks/scale.py --params 1e6 --ranks 4 8 --rounds 3   # a quick look
    python benchmarks/scale.py --json                           # one JSON line per cell
    python benchmarks/scale.py --direct 1   # relayed cells: the last worker dials directly

Each cell is a real ``meshkit run`` in this process (the coordinator) with
a local launch: a federated job, one client per worker, ``average`` outer
optimizer, on the ``synthetic`` task, whose fit is a seeded perturbation of
the state, so a round's cost is what the mesh does with the model. The
baseline is the flat star (every worker dials the coordinator); the other
columns put the same workers behind 2 or 4 host relays (``[mesh] relays``,
contiguous blocks of ranks), which fold their ranks' contributions and fan
the state out, so the coordinator sees one contribution per relay.

Measured per cell, over the rounds after the first (the first pays the
connection warm-up): seconds per round (``seconds`` in ``metrics.jsonl``;
median, with min-max) and the frame body bytes through the coordinator per
round (received + sent, counted by the tcp group; median). Printed ratios:
relayed / flat for both, and the bytes per round divided by the model size
(the target: proportional to relays, not ranks -- about 2 models per relay
and round against 2 per rank for the flat star).

Everything runs on this one machine: relays, workers and coordinator share
its cores, so seconds per round says what the coordinator's single process
costs, not what separate hosts would take. This is a benchmark, not a test:
it asserts nothing, and its numbers depend on the machine and its load.

The torch.distributed part of issue 16 (``torchdist`` data-parallel step
time against torch DDP) is :func:`torchdist_vs_ddp` below, kept apart.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def write_config(path: Path, out: Path, *, workers: int, relays: int, params: int,
                 rounds: int, timeout: float) -> Path:
    path.write_text(textwrap.dedent(f"""
        [run]
        task = "synthetic"
        seed = 0
        out = "{out}"

        [mesh]
        launch = "local"
        workers = {workers}
        relays = {relays}
        timeout = {timeout}
        join_timeout = {max(60.0, 10.0 * workers)}

        [strategy]
        name = "federated"
        rounds = {rounds}
        clients = {workers}
        min_clients = {workers}

        [task]
        params = {params}
        rows = {max(1024, workers)}

        [outer_optimizer]
        name = "average"
    """))
    return path


def run_cell(workers: int, relays: int, *, params: int, rounds: int,
             timeout: float, direct: int = 0) -> dict[str, Any]:
    """One ``meshkit run``: per-round seconds and coordinator bytes (after round 1).

    ``direct``: with relays, that many workers (the last ranks) dial the
    coordinator directly, beside the relays (``[mesh] relays`` has no such
    setting: the benchmark narrows the launcher's relay blocks).
    """
    from meshkit.train import Runner
    from meshkit.train._coordinator import launch as _launch

    blocks = _launch.relay_blocks
    if relays and direct:
        _launch.relay_blocks = lambda w, r: blocks(w - direct, r)  # type: ignore[assignment]

    with tempfile.TemporaryDirectory(prefix="meshkit-scale-") as tmp:
        config = write_config(Path(tmp) / "scale.toml", Path(tmp) / "out", workers=workers,
                              relays=relays, params=params, rounds=rounds, timeout=timeout)
        runner = Runner(str(config))
        seconds: list[float] = []
        traffic: list[int] = []
        last = [0]

        def on_round(report: Any, state: Any) -> None:
            group = runner._group  # the coordinator's tcp group (benchmark-only peek)
            total = int(group.bytes_in + group.bytes_out)
            seconds.append(float(report.seconds))
            traffic.append(total - last[0])
            last[0] = total

        runner.on_round = on_round
        started = time.perf_counter()
        try:
            report = runner.run()
        finally:
            _launch.relay_blocks = blocks  # type: ignore[assignment]
        wall = time.perf_counter() - started
    if not report.ok:
        raise SystemExit(f"{workers} ranks, {relays} relays: the run failed: {report.error}")
    kept_s, kept_b = seconds[1:] or seconds, traffic[1:] or traffic
    return {"ranks": workers, "relays": relays, "direct": direct if relays else 0,
            "params": params,
            "model_bytes": params * 4, "rounds": len(seconds),
            "seconds": statistics.median(kept_s), "seconds_min": min(kept_s),
            "seconds_max": max(kept_s), "bytes": int(statistics.median(kept_b)),
            "wall": wall}


def torchdist_vs_ddp(args: argparse.Namespace) -> None:
    """``torchdist`` data-parallel step time against torch DDP (gloo), world 4.

    ``benchmarks/scale_torchdist.py`` with its own defaults (4 replicas, 3
    trials), run as ``python benchmarks/scale.py --part torchdist``.
    """
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import scale_torchdist  # type: ignore[import-not-found]

    scale_torchdist.main([])  # its own defaults: 4 replicas (scale.py's flags are not its)


def _ratio(value: float | None, width: int, places: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{places}f}"


def relays_vs_flat(args: argparse.Namespace) -> None:
    print(f"# meshkit benchmarks/scale.py  {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    try:
        print(f"# load (uptime): {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} "
              f"{os.getloadavg()[2]:.2f}, {os.cpu_count()} cpus")
    except OSError:
        pass
    params = int(float(args.params))
    print(f"# model: {params} float32 ({params * 4 / 1e6:.1f} MB), federated, "
          f"{args.rounds} rounds (round 1 not counted)")
    if not args.json:
        print(f"{'ranks':>5} {'relays':>6} {'s/round':>9} {'(min-max)':>17} "
              f"{'coord MB/round':>15} {'models/round':>12} {'s ratio':>8} {'bytes ratio':>11}")
    for ranks in args.ranks:
        flat: dict[str, Any] | None = None
        for relays in args.relays:
            if relays > ranks:
                continue
            cell = run_cell(ranks, relays, params=params, rounds=args.rounds,
                            timeout=args.timeout, direct=args.direct)
            if relays == 0:
                flat = cell
            # Against the flat star of the same rank count; none measured
            # (--relays without 0, or 0 not first): no ratio, rather than 1.00.
            cell["seconds_ratio"] = cell["seconds"] / flat["seconds"] if flat else None
            cell["bytes_ratio"] = cell["bytes"] / flat["bytes"] if flat else None
            cell["models_per_round"] = cell["bytes"] / cell["model_bytes"]
            if args.json:
                print(json.dumps(cell))
            else:
                spread = f"({cell['seconds_min']:.3f}-{cell['seconds_max']:.3f})"
                label = (f"{relays}+{cell['direct']}d" if cell["direct"] else relays) or "flat"
                print(f"{ranks:>5} {label:>6} {cell['seconds']:>9.3f} "
                      f"{spread:>17} {cell['bytes'] / 1e6:>15.1f} "
                      f"{cell['models_per_round']:>12.2f} {_ratio(cell['seconds_ratio'], 8, 2)} "
                      f"{_ratio(cell['bytes_ratio'], 11, 3)}")
            sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["relays", "torchdist"], default="relays")
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--relays", type=int, nargs="+", default=[0, 2, 4],
                        help="relay counts to compare (0: the flat star, the baseline)")
    parser.add_argument("--params", default="2.5e6", help="model size in float32 parameters")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--direct", type=int, default=0,
                        help="in the relayed cells, workers that dial the coordinator "
                             "directly beside the relays (the last ranks)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.chdir(ROOT)
    if args.part == "torchdist":
        torchdist_vs_ddp(args)
    else:
        relays_vs_flat(args)


if __name__ == "__main__":
    main()
