"""All-reduce throughput: meshkit's mesh all-reduce vs torch.distributed gloo.

Every rank is a separate process on this machine (loopback TCP), and every
rank contributes a float32 vector of the given size and gets the mean back.
(The star reduce service and its kinds -- ``meshkit``, ``meshkit-auth``,
``meshkit-nomac``, ``meshkit-sync`` -- were removed with the service in
issue 21; a star's rounds fold on the round engine, which
``benchmarks/scale.py`` measures.)

* ``mesh``: ``tcp`` transport, full mesh, bodies encrypted (the default):
  every rank calls ``group.mesh_all_reduce`` (ring reduce-scatter +
  all-gather over the direct links, no coordinator fold), weighted mean;
  timed on rank 0 like the others ("mesh vs gloo" column).
* ``mesh-auth``: the same mesh with ``encrypt=False``: every frame
  authenticated (header HMAC, body GMAC), bodies in clear, as gloo's are
  ("auth vs gloo" column). Asking for ``mesh`` runs both, interleaved.
* ``mesh-auth-copy``: ``mesh-auth`` with segments received the way they were
  before they landed in place (into the channel's receive buffer, then
  added or copied from there: the links' ``receive_into`` hidden), to
  measure what landing in place saves in the same run ("landing gain"
  column: > 0 means landing is faster).
* ``gloo``: ``torch.distributed.all_reduce`` with the gloo backend (the
  named baseline; install with ``pip install torch==2.13.0`` or the
  ``bench`` extra).

Timing, the same for both systems: rounds run back to back, as in a
training loop; each is timed on rank 0 from the start of its call to its
return (meshkit: ``mesh_all_reduce``; gloo: ``all_reduce``). This is
throughput: a round's time includes waiting for the other ranks to finish
the previous one, as nccl-tests and gloo's own benchmark count it.

Each configuration runs ``--trials`` times (default 7 at 1 MiB, else 3), the kinds
interleaved (mesh, mesh-auth, gloo, ...) so that a load spike on a shared
machine hits all of them alike. A trial's figure is the median of its
timed rounds; the figure reported is the best trial (interference only
ever slows a trial down; on the development machine whole trials land in
a slow mode about 1.6x slower), and ``--json`` keeps every trial. Ratios
> 1 mean meshkit is faster. Run::

    python benchmarks/allreduce.py                      # worlds 2 and 4, 1/16/64 MiB
    python benchmarks/allreduce.py --kinds mesh gloo    # the mesh, encrypted and auth-only
    python benchmarks/allreduce.py --worlds 2 --sizes 1 16 --reps 5 --trials 1

``--against REF`` also runs every meshkit kind asked for on the code of git
revision REF (``git archive`` of its ``meshkit/`` and ``plugins/`` into a
temporary directory, first on ``PYTHONPATH`` of a child process that runs
that kind), interleaved with the current code's in the same trials: column
``K@REF``, ratio ``K vs REF`` (> 1: the current code is faster). What a
refactor of the wire hot path must show::

    python benchmarks/allreduce.py --worlds 2 4 --sizes 1 16 --kinds mesh --no-gloo \
        --against main

This is a measurement, not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from meshkit.train import free_ports

SECRET = b"benchmark-secret"



def _mesh_rank(rank: int, world: int, nbytes: int, reps: int, warmup: int, peers: list[str],
               results: Any, encrypt: bool = True, land: bool = True) -> None:
    from meshkit_tcp import TcpOptions
    from meshkit_tcp.tcp import TcpTransport

    from meshkit.node.config import NodeConfig

    transport = TcpTransport(TcpOptions(max_frame_bytes=1 << 31))
    config = NodeConfig(rank=rank, world=world, topology="mesh", peers=peers, secret=SECRET,
                        timeout=120, encrypt=encrypt)
    group = transport.connect(config)
    if not land:
        # The Links contract's default: nothing registered, so the ring
        # receives every segment as a frame and copies it.
        group._links.receive_into = lambda peer, tag, placer: None
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
               results: Any) -> None:
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
    if kind in ("mesh", "mesh-auth", "mesh-auth-copy"):
        peers = [f"127.0.0.1:{port}" for port in free_ports(world)]
        procs = [ctx.Process(target=_mesh_rank, args=(r, world, nbytes, reps, warmup, peers,
                                                       results, kind == "mesh",
                                                       kind != "mesh-auth-copy"))
                 for r in range(world)]
    else:
        port = free_ports(1)[0]
        procs = [ctx.Process(target=_gloo_rank, args=(r, world, nbytes, reps, warmup, port,
                                                       results))
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


#: Kinds run at ``--against REF`` are named ``KIND@REF``.
_AT = "@"


def _checkout(ref: str) -> str:
    """A temporary directory holding ``meshkit/`` and ``plugins/`` as of git revision ``ref``."""
    root = Path(__file__).resolve().parents[1]
    tree = tempfile.mkdtemp(prefix="meshkit-at-")
    archive = subprocess.run(["git", "-C", str(root), "archive", "--format=tar", ref,
                              "meshkit", "plugins"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
    return tree


def _run_at(tree: str, kind: str, world: int, nbytes: int, reps: int, warmup: int) -> float:
    """:func:`_run` in a child process whose meshkit (and its plugins) come from ``tree``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [tree, os.path.join(tree, "plugins"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, __file__, "--one", kind, str(world), str(nbytes),
                           str(reps), str(warmup), tree], env=env, capture_output=True,
                          text=True, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} at {tree} failed:\n{done.stderr[-2000:]}")
    return float(done.stdout.split()[-1])


def _one(kind: str, world: str, nbytes: str, reps: str, warmup: str, tree: str) -> int:
    """``--one``: time one kind here (a child of ``--against``) and print its median."""
    import meshkit
    import meshkit_tcp

    for module in (meshkit, meshkit_tcp):  # the code under test, not the installed one
        if not str(module.__file__).startswith(tree):
            raise RuntimeError(f"{module.__name__} was imported from {module.__file__}, "
                               f"not from {tree}")
    print(_run(kind, int(world), int(nbytes), int(reps), int(warmup)))
    return 0


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


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
                        help="only these kinds (default: all); 'mesh' also runs mesh-auth")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--against", metavar="REF",
                        help="also run each meshkit kind on git revision REF, interleaved")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--one"]:
        return _one(*argv[1:7])
    args = parser.parse_args(argv)

    kinds = ["mesh", "mesh-auth", "mesh-auth-copy"]
    if args.kinds:
        wanted = set(args.kinds)
        if "mesh" in wanted:
            wanted.add("mesh-auth")
        kinds = [k for k in kinds if k in wanted]
    else:
        kinds.remove("mesh-auth-copy")  # a comparison of two ring variants: asked for by name
    if not args.no_gloo and (not args.kinds or "gloo" in args.kinds):
        try:
            import torch  # noqa: F401
            kinds += ["gloo"]
        except ImportError:
            print("torch is not installed: skipping the gloo baseline "
                  "(pip install torch==2.13.0)", file=sys.stderr)
    if not kinds:
        parser.error("no kind to run")
    tree = None
    if args.against:
        tree = _checkout(args.against)
        # Each kind beside its run at REF, so a load spike hits both alike.
        kinds = [run for k in kinds for run in (
            [k] if k.startswith("gloo") else [k, f"{k}{_AT}{args.against}"])]

    print(f"# meshkit all-reduce vs gloo, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPU(s), python {platform.python_version()}; ms per round, "
          f"the best trial (each the median of its rounds); load {_load()}")
    # The ratio columns this run can fill: (label, numerator kind, denominator kind);
    # "x" columns are throughput ratios (> 1: the first kind is faster), "%" costs.
    ratios = [(label, a, b, unit) for label, a, b, unit in (
        ("mesh vs gloo", "gloo", "mesh", "x"),
        ("auth vs gloo", "gloo", "mesh-auth", "x"),
        ("mesh enc cost", "mesh", "mesh-auth", "%"),
        ("landing gain", "mesh-auth-copy", "mesh-auth", "%"),
        *((f"{k} vs {args.against}", f"{k}{_AT}{args.against}", k, "x")
          for k in kinds if _AT not in k and not k.startswith("gloo")),
    ) if a in kinds and b in kinds]
    widths = {k: max(len(k) + 3, 9) for k in kinds}
    header = (f"{'world':>5} {'MiB':>4} " + " ".join(f"{k + ' ms':>{widths[k]}}" for k in kinds)
              + "".join(f" {label + ' (trials)':>{len(label) + 18}}" for label, *_ in ratios))
    print(header, flush=True)
    rows = []
    for world in args.worlds:
        for mib in args.sizes:
            nbytes = mib << 20
            # Small rounds are short and noisy on a shared machine: time more of them.
            reps = args.reps or (100 if mib <= 1 else 20 if mib <= 16 else 8)
            trials: dict[str, list[float]] = {k: [] for k in kinds}
            for _ in range(args.trials if args.trials > 0 else 7 if mib <= 1 else 3):
                for k in kinds:  # interleaved: a load spike hits every kind alike
                    if _AT in k:
                        assert tree is not None
                        trials[k].append(_run_at(tree, k.split(_AT)[0], world, nbytes, reps,
                                                 warmup=2))
                    else:
                        trials[k].append(_run(k, world, nbytes, reps, warmup=2))
            times = {k: min(v) for k, v in trials.items()}
            row: dict[str, Any] = {
                "world": world, "mib": mib, "reps": reps, "trials": len(trials[kinds[0]]),
                "load": _load(),
                **{f"{k}_s": t for k, t in times.items()},
                **{f"{k}_median_of_trials_s": statistics.median(v) for k, v in trials.items()},
                **{f"{k}_trials_s": v for k, v in trials.items()}}
            if "mesh" in times:
                row["mesh_MBps"] = nbytes / times["mesh"] / 1e6
            cells = []
            for label, a, b, unit in ratios:
                key = label.replace(" ", "_")
                # The best trials' ratio, and the range over trial pairs run
                # back to back (the spread a shared machine adds).
                per_trial = [x / y for x, y in zip(trials[a], trials[b])]
                best = times[a] / times[b]
                if unit == "%":
                    best, per_trial = best - 1, [p - 1 for p in per_trial]
                    text = f"{best:.0%} ({min(per_trial):.0%}..{max(per_trial):.0%})"
                else:
                    text = f"{best:.2f}x ({min(per_trial):.2f}..{max(per_trial):.2f})"
                row[key] = best
                row[f"{key}_per_trial"] = per_trial
                cells.append(f" {text:>{len(label) + 18}}")
            rows.append(row)
            print(f"{world:>5} {mib:>4} "
                  + " ".join(f"{times[k] * 1e3:>{widths[k]}.2f}" for k in kinds)
                  + "".join(cells), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)
    if tree is not None:
        shutil.rmtree(tree, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
