"""All-reduce throughput: meshkit's star reduce service vs torch.distributed gloo.

Every rank is a separate process on this machine (loopback TCP), and every
rank contributes a float32 vector of the given size and gets the mean back:

* ``meshkit``: ``tcp`` transport, star topology, the default: bodies
  AES-256-GCM encrypted. Rank 0 folds its own contribution
  (``reduce_round(..., contribution=x)``) and the workers' (``all_reduce``),
  then scatters the mean.
* ``meshkit-auth``: the same with ``encrypt=False`` (``[mesh] encrypt =
  false``): authenticated only (header HMAC, body GMAC), to measure what
  encryption costs ("enc cost" column).
* ``meshkit-nomac``: the same path with frame MACs off on both ends
  (``benchmark_only_disable_mac``; the handshake is still authenticated),
  to measure what authentication costs.
* ``mesh``: ``tcp`` transport, full mesh, bodies encrypted (the default):
  every rank calls ``group.mesh_all_reduce`` (ring reduce-scatter +
  all-gather over the direct links, no coordinator fold), weighted mean;
  timed on rank 0 like the others ("mesh vs gloo" column).
* ``gloo``: ``torch.distributed.all_reduce`` with the gloo backend (the
  named baseline; install with ``pip install torch==2.13.0`` or the
  ``bench`` extra).

Two ways of timing, the same for both systems:

* back to back (``meshkit``, ``meshkit-nomac``, ``gloo``): rounds run one
  after another, as in a training loop; each is timed on rank 0 from the
  start of its call to its return (meshkit: ``reduce_round``, which ends
  when the scatter is written; gloo: ``all_reduce``). This is throughput:
  a round's time includes waiting for the other ranks to finish the
  previous one, as nccl-tests and gloo's own benchmark count it.
* synchronized (``meshkit-sync``, ``gloo-sync``): every rank first passes a
  barrier (gloo: ``dist.barrier()``; meshkit: a one-element all-reduce),
  and only the round after it is timed: the latency of one round that
  starts with every rank ready.

Each configuration runs ``--trials`` times (default 7 at 1 MiB, else 3), the kinds
interleaved (meshkit, nomac, gloo, ...) so that a load spike on a shared
machine hits all of them alike. A trial's figure is the median of its
timed rounds; the figure reported is the best trial (interference only
ever slows a trial down; on the development machine whole trials land in
a slow mode about 1.6x slower), and ``--json`` keeps every trial. Ratios
> 1 mean meshkit is faster. Run::

    python benchmarks/allreduce.py                      # worlds 2 and 4, 1/16/64 MiB
    python benchmarks/allreduce.py --worlds 2 --sizes 1 16 --reps 5 --trials 1

This is a measurement, not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import time
from typing import Any

import numpy as np

SECRET = b"benchmark-secret"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _meshkit_rank(rank: int, world: int, nbytes: int, reps: int, warmup: int, mac: bool,
                  address: Any, results: Any, sync: bool = False, encrypt: bool = True) -> None:
    from meshkit_tcp import TcpOptions
    from meshkit_tcp.tcp import TcpTransport

    from meshkit import plugins
    from meshkit.node.config import NodeConfig

    transport = TcpTransport(TcpOptions(max_frame_bytes=1 << 31),
                             benchmark_only_disable_mac=not mac)
    x = np.full(nbytes // 4, float(rank + 1), np.float32)
    state = {"x": x}
    barrier = {"b": np.zeros(1, np.float32)}
    if rank == 0:
        config = NodeConfig(rank=0, world=world, topology="star", bind="127.0.0.1:0",
                            secret=SECRET, timeout=120, encrypt=encrypt)
        group = transport.connect(config)
        for _ in range(world - 1):
            address.put(group.address)
        fedavg = plugins.create("aggregator", "fedavg")
        try:
            group.wait_for_workers(timeout=120)
            times = []
            for i in range(warmup + reps):
                if sync:
                    group.reduce_round(fedavg, contribution=barrier, timeout=120)
                start = time.perf_counter()
                result = group.reduce_round(fedavg, contribution=state, timeout=120)
                elapsed = time.perf_counter() - start
                if i >= warmup:
                    times.append(elapsed)
            expected = (world + 1) / 2
            if not np.allclose(result.consensus["x"][:4], expected):
                raise AssertionError(f"wrong mean {result.consensus['x'][:4]} != {expected}")
            results.put(times)
        finally:
            group.close()
        return
    coordinator = address.get(timeout=120)
    config = NodeConfig(rank=rank, world=world, topology="star", peers=[coordinator],
                        secret=SECRET, timeout=120, encrypt=encrypt)
    group = transport.connect(config)
    try:
        for _ in range(warmup + reps):
            if sync:
                group.all_reduce(barrier, timeout=240)
            group.all_reduce(state, timeout=240)
    finally:
        group.close()


def _mesh_rank(rank: int, world: int, nbytes: int, reps: int, warmup: int, peers: list[str],
               results: Any) -> None:
    from meshkit_tcp import TcpOptions
    from meshkit_tcp.tcp import TcpTransport

    from meshkit.node.config import NodeConfig

    transport = TcpTransport(TcpOptions(max_frame_bytes=1 << 31))
    config = NodeConfig(rank=rank, world=world, topology="mesh", peers=peers, secret=SECRET,
                        timeout=120)
    group = transport.connect(config)
    x = np.full(nbytes // 4, float(rank + 1), np.float32)
    try:
        times = []
        for i in range(warmup + reps):
            start = time.perf_counter()
            mean = group.mesh_all_reduce({"x": x}, weight=1.0, timeout=120)
            elapsed = time.perf_counter() - start
            if i >= warmup:
                times.append(elapsed)
        expected = (world + 1) / 2
        if not np.allclose(mean["x"][:4], expected):
            raise AssertionError(f"wrong mean {mean['x'][:4]} != {expected}")
        if rank == 0:
            results.put(times)
    finally:
        group.close()


def _gloo_rank(rank: int, world: int, nbytes: int, reps: int, warmup: int, port: int,
               results: Any, barrier: bool = False) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        x = torch.full((nbytes // 4,), float(rank + 1), dtype=torch.float32)
        times = []
        dist.barrier()
        for i in range(warmup + reps):
            if barrier:
                dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            elapsed = time.perf_counter() - start
            x.div_(world)  # keep the values bounded, like a mean
            if i >= warmup:
                times.append(elapsed)
        if rank == 0:
            results.put(times)
    finally:
        dist.destroy_process_group()


def _run(kind: str, world: int, nbytes: int, reps: int, warmup: int) -> float:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    if kind == "mesh":
        peers = [f"127.0.0.1:{_free_port()}" for _ in range(world)]
        procs = [ctx.Process(target=_mesh_rank, args=(r, world, nbytes, reps, warmup, peers,
                                                       results))
                 for r in range(world)]
    elif kind.startswith("gloo"):
        port = _free_port()
        procs = [ctx.Process(target=_gloo_rank, args=(r, world, nbytes, reps, warmup, port,
                                                       results, kind == "gloo-sync"))
                 for r in range(world)]
    else:
        address = ctx.Queue()
        procs = [ctx.Process(target=_meshkit_rank,
                             args=(r, world, nbytes, reps, warmup, kind != "meshkit-nomac",
                                   address, results, kind == "meshkit-sync",
                                   kind not in ("meshkit-auth", "meshkit-nomac")))
                 for r in range(world)]
    for proc in procs:
        proc.start()
    try:
        times = results.get(timeout=600)
    finally:
        for proc in procs:
            proc.join(120)
            if proc.is_alive():
                proc.kill()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 64], help="MiB")
    parser.add_argument("--reps", type=int, default=0, help="timed repetitions (0: by size)")
    parser.add_argument("--trials", type=int, default=0,
                        help="independent runs of each kind, interleaved, the best reported "
                             "(0: 7 at 1 MiB or less, where whole runs land in a slow mode "
                             "most often, else 3)")
    parser.add_argument("--no-gloo", action="store_true", help="skip the torch baseline")
    parser.add_argument("--kinds", nargs="+", default=None,
                        help="only these kinds (meshkit and meshkit-auth always run)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)

    kinds = ["meshkit", "meshkit-auth", "meshkit-nomac", "meshkit-sync", "mesh"]
    if args.kinds:
        kinds = ["meshkit", "meshkit-auth", *[k for k in kinds[2:] if k in args.kinds]]
    if not args.no_gloo and (not args.kinds or "gloo" in args.kinds):
        try:
            import torch  # noqa: F401
            kinds += ["gloo", "gloo-sync"]
        except ImportError:
            print("torch is not installed: skipping the gloo baseline "
                  "(pip install torch==2.13.0)", file=sys.stderr)

    print(f"# meshkit all-reduce vs gloo, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPU(s), python {platform.python_version()}; ms per round, "
          f"the best trial (each the median of its rounds)")
    widths = {k: max(len(k) + 3, 9) for k in kinds}
    header = (f"{'world':>5} {'MiB':>4} " + " ".join(f"{k + ' ms':>{widths[k]}}" for k in kinds)
              + f" {'MB/s':>6} {'vs gloo':>8} {'vs gloo-sync':>13} {'MAC cost':>9}"
              + f" {'enc cost':>9} {'enc spread':>17} {'mesh vs gloo':>13}")
    print(header)
    rows = []
    for world in args.worlds:
        for mib in args.sizes:
            nbytes = mib << 20
            # Small rounds are short and noisy on a shared machine: time more of them.
            reps = args.reps or (100 if mib <= 1 else 20 if mib <= 16 else 8)
            trials: dict[str, list[float]] = {k: [] for k in kinds}
            for _ in range(args.trials if args.trials > 0 else 7 if mib <= 1 else 3):
                for k in kinds:
                    trials[k].append(_run(k, world, nbytes, reps, warmup=2))
            times = {k: min(v) for k, v in trials.items()}
            row = {"world": world, "mib": mib, "reps": reps, "trials": len(trials["meshkit"]),
                   **{f"{k}_s": t for k, t in times.items()},
                   **{f"{k}_median_of_trials_s": statistics.median(v) for k, v in trials.items()},
                   **{f"{k}_trials_s": v for k, v in trials.items()}}
            row["meshkit_MBps"] = nbytes / times["meshkit"] / 1e6
            if "meshkit-nomac" in times:
                row["mac_overhead"] = times["meshkit-auth"] / times["meshkit-nomac"] - 1
            # Encryption's cost: the best trials, and the range over trial pairs
            # run back to back (the spread a shared machine adds).
            row["encryption_overhead"] = times["meshkit"] / times["meshkit-auth"] - 1
            pairs = [e / a - 1 for e, a in zip(trials["meshkit"], trials["meshkit-auth"])]
            row["encryption_overhead_per_trial"] = pairs
            if "gloo" in times and "gloo-sync" in times and "meshkit-sync" in times:
                row["vs_gloo"] = times["gloo"] / times["meshkit"]
                row["vs_gloo_sync"] = times["gloo-sync"] / times["meshkit-sync"]
            if "gloo" in times and "mesh" in times:
                row["mesh_vs_gloo"] = times["gloo"] / times["mesh"]
                row["mesh_vs_gloo_per_trial"] = [g / m for g, m in zip(trials["gloo"],
                                                                       trials["mesh"])]
            rows.append(row)
            vs = f"{row['vs_gloo']:.2f}x" if "vs_gloo" in row else "-"
            vs_sync = f"{row['vs_gloo_sync']:.2f}x" if "vs_gloo_sync" in row else "-"
            print(f"{world:>5} {mib:>4} "
                  + " ".join(f"{times[k] * 1e3:>{widths[k]}.2f}" for k in kinds)
                  + f" {row['meshkit_MBps']:>6.0f} {vs:>8} {vs_sync:>13} "
                  + (f"{row['mac_overhead']:>8.0%}" if "mac_overhead" in row else f"{'-':>8}")
                  + f" {row['encryption_overhead']:>9.0%}"
                  + f" {min(pairs):>7.0%}..{max(pairs):<7.0%}"
                  + (f" {row['mesh_vs_gloo']:>12.2f}x" if "mesh_vs_gloo" in row else f" {'-':>13}"),
                  flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
