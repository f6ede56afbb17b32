"""The wire's per-frame cost against a named git revision, and what resuming costs a big message.

* **small frames**: a state of about 1 KiB echoed over a real encrypted
  channel pair on 127.0.0.1 (two threads of one process, the default
  frames), ``--batches`` batches of ``--trips`` round trips; a run's figures
  are the median batch's µs per round trip, wall clock and CPU (the
  process's, both ends: on a loaded machine the wall clock mostly measures
  the wait for a core, the CPU time what the code costs). With ``--against REF`` every run
  alternates this tree and REF's (``git archive`` of its ``meshkit/`` into a
  temporary directory, first on ``PYTHONPATH`` of a child process), so a load
  spike hits both alike; the ratio is REF's median over this tree's (> 1:
  this tree is faster). ``--entries N`` makes the state a model's shape
  instead: N entries (N - 1 arrays of 4 float32 and a step counter), the
  per-entry cost of the codec (a round's requests carry 9-11 entries, a
  torch model's state hundreds).
* **big message** (``--big MiB``, this tree only): one message of that size
  sent segmented as ``send_encoded`` and as ``send_resumable`` (which adds
  the transfer's digest pass on both ends), alternating, ``--big-runs``
  times: MB/s each and their ratio.

    python benchmarks/wire_frames.py --against main --runs 6 --big 256

A measurement, not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECRET = b"benchmark secret, not a real one"


def _pair(**kwargs):  # type: ignore[no-untyped-def]
    from meshkit import wire

    with socket.create_server(("127.0.0.1", 0)) as listener:
        dialer = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault(
        "b", wire.handshake(accepted, SECRET, rank=1, world=2, timeout=60.0, **kwargs)))
    thread.start()
    a = wire.handshake(dialer, SECRET, rank=0, world=2, timeout=60.0, **kwargs)
    thread.join()
    return a, out["b"]


def small_frames(trips: int, batches: int, entries: int = 2) -> tuple[float, float]:
    """Median µs per round trip (wall, CPU) of a ~1 KiB state over an encrypted channel pair
    (``entries`` > 2: that many entries, each array of 4 float32)."""
    import numpy as np

    a, b = _pair()
    state: dict[str, object] = {"x": np.arange(240, dtype=np.float32), "step": 1}
    if entries > 2:
        state = {f"layer{i}.weight": np.full(4, i, dtype=np.float32) for i in range(entries - 1)}
        state["step"] = 1

    def echo() -> None:
        for _ in range(trips * batches + 1):
            frame = b.recv(timeout=60)
            b.send(1, 2, frame.state)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    a.send(1, 2, state)
    a.recv(timeout=60)  # warm
    figures, cpu = [], []
    for _ in range(batches):
        start, start_cpu = time.perf_counter(), time.process_time()
        for _ in range(trips):
            a.send(1, 2, state)
            a.recv(timeout=60)
        figures.append((time.perf_counter() - start) / trips * 1e6)
        cpu.append((time.process_time() - start_cpu) / trips * 1e6)
    thread.join(60)
    a.close(), b.close()
    return statistics.median(figures), statistics.median(cpu)


def big_message(mib: int, runs: int) -> dict[str, list[float]]:
    """MB/s of one ``mib`` MiB message, plain segmented and resumable, alternating."""
    import numpy as np

    from meshkit import wire

    a, b = _pair()
    state = {"w": np.random.default_rng(0).standard_normal(mib << 18).astype(np.float32)}
    encoded = wire.encode_state(state)
    out: dict[str, list[float]] = {"segmented": [], "resumable": []}
    for _ in range(runs):
        for kind in ("segmented", "resumable"):
            transfer = wire.Transfer(encoded)  # a fresh one: its digest is computed in the send
            start = time.perf_counter()
            receiving = threading.Thread(target=lambda: b.recv(timeout=120))
            receiving.start()
            if kind == "segmented":
                a.send_encoded(1, 2, encoded)
            else:
                a.send_resumable(1, 2, transfer)
            receiving.join()
            out[kind].append(encoded.nbytes / (time.perf_counter() - start) / 1e6)
    a.close(), b.close()
    return out


def _checkout(ref: str) -> Path:
    tree = Path(tempfile.mkdtemp(prefix="wire-frames-"))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "meshkit"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def _child(tree: Path | None, trips: int, batches: int, entries: int) -> tuple[float, float]:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = f"{tree}{os.pathsep}{env.get('PYTHONPATH', '')}"
    cmd = [sys.executable, __file__, "--one", "--trips", str(trips), "--batches", str(batches),
           "--entries", str(entries)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd="/")
    wall, cpu = out.stdout.strip().splitlines()[-1].split()
    return float(wall), float(cpu)


def _spread(values: list[float]) -> str:
    """Median (min-max): on a shared machine interference only slows a run down, so the
    best run (min of times, max of rates) is the steadier figure; both are printed."""
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", metavar="REF", help="git revision to compare with")
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--trips", type=int, default=2000)
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--entries", type=int, default=2,
                        help="entries in the small frames' state (default 2: ~1 KiB, 2 entries)")
    parser.add_argument("--big", type=int, default=0, metavar="MiB")
    parser.add_argument("--big-runs", type=int, default=3)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.one:
        print(*small_frames(args.trips, args.batches, args.entries))
        return
    report: dict[str, object] = {"load_before": os.getloadavg()[0]}
    tree = _checkout(args.against) if args.against else None
    try:
        runs: dict[str, list[tuple[float, float]]] = {"this": [], str(args.against): []}
        for _ in range(args.runs):
            runs["this"].append(_child(None, args.trips, args.batches, args.entries))
            if tree is not None:
                runs[str(args.against)].append(_child(tree, args.trips, args.batches, args.entries))
        report["small_us_wall_cpu"] = runs
        for which, measure in ((0, "wall"), (1, "CPU")):
            here = [r[which] for r in runs["this"]]
            there = [r[which] for r in runs[str(args.against)]]
            if not here:
                break
            what = "1 KiB" if args.entries <= 2 else f"{args.entries}-entry"
            line = f"{what} round trip ({measure}), this tree: {_spread(here)} µs"
            if there:
                ratio = statistics.median(there) / statistics.median(here)
                best = min(there) / min(here)
                report[f"ratio_{measure}"], report[f"ratio_{measure}_best"] = ratio, best
                line += (f"; {args.against}: {_spread(there)} µs; ratio {args.against}/this "
                         f"{ratio:.3f} of medians, {best:.3f} of the best runs "
                         f"(> 1: this tree is faster)")
            print(line)
    finally:
        if tree is not None:
            shutil.rmtree(tree, ignore_errors=True)
    if args.big:
        big = big_message(args.big, args.big_runs)
        report["big_MBps"] = big
        ratio = statistics.median(big["resumable"]) / statistics.median(big["segmented"])
        print(f"{args.big} MiB message: segmented {_spread(big['segmented'])} MB/s, "
              f"resumable {_spread(big['resumable'])} MB/s; ratio {ratio:.3f}")
    report["load_after"] = os.getloadavg()[0]
    print(f"load average {report['load_before']:.1f} before, {report['load_after']:.1f} after")
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
