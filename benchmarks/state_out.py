"""The round's state out to every worker: written one link after another, or all at once (issue 39).

Run (from the repository root, in the dev venv)::

    python benchmarks/state_out.py                      # 100M float32 (400 MB), 2 workers
    python benchmarks/state_out.py --params 25e6 --workers 3 --repeat 9

A real TCP star on 127.0.0.1: this process is rank 0 with a
:class:`meshkit.train.GroupPool`, and each worker is its own process that
acknowledges every ``set_state`` request once the whole state has arrived (a
worker's receive, nothing else; ``--recycle N``: each worker keeps N received
bodies for reuse, ``meshkit.wire.recycle_large_messages``, and the workers'
own minor faults and CPU are printed at the end). A trial sends the same state to every
worker and waits for every acknowledgement; its seconds are from the first
send to the last acknowledgement. The two ways take turns trial by trial in
the same run: *sequential* (every request written on this thread, one worker
after another: the pool's way before issue 39's change, forced here by
raising ``CONCURRENT_BYTES`` above the state) and *concurrent* (the pool's
default: a writer thread per link). Printed: the median and range of each,
the ratio per pair of trials (sequential / concurrent: above 1, the
concurrent way is faster), and the load average before and after. A
benchmark, not a test: it asserts nothing, and its numbers depend on the
machine's load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import textwrap
import time

import numpy as np

from meshkit.node.config import NodeConfig
from meshkit.train import GroupPool
from meshkit.train import _pool

SECRET = "state-out-benchmark-secret"

WORKER = textwrap.dedent("""
    import resource, sys
    from meshkit import wire
    from meshkit.node.config import NodeConfig
    from meshkit.train import TAG_REPLY, TAG_REQUEST
    rank, world, address = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    wire.recycle_large_messages(int(sys.argv[5]))
    group = NodeConfig(rank=rank, world=world, peers=[address], topology="star",
                       secret=sys.argv[4].encode(), timeout=120.0).connect()
    for _ in range(10_000):  # bounded; a "stop" ends it
        request = group.recv(0, TAG_REQUEST, timeout=600)
        if request.get("op") == "stop":
            break
        held = request  # the state is held until the next one arrives, as a worker's
        group.send(0, TAG_REPLY, {"seq": request["seq"]})
    group.close()
    use = resource.getrusage(resource.RUSAGE_SELF)
    print(f"usage {use.ru_minflt} {use.ru_utime} {use.ru_stime}", flush=True)
""")


def trial(pool: GroupPool, workers: list[int], state: dict) -> float:
    started = time.perf_counter()
    for rank in workers:
        pool.send(rank, {"op": "set_state", "state": state}, timeout=600.0)
    for _ in workers:
        reply = pool.receive()
        assert reply is not None and reply.ok, reply
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=7, help="trials of each way")
    parser.add_argument("--recycle", type=int, default=0,
                        help="the workers' wire.recycle_large_messages(N): received bodies "
                             "above 64 MiB they keep for reuse (0: each one fresh memory)")
    args = parser.parse_args(argv)
    params, world = int(args.params), args.workers + 1
    state = {"w": np.random.default_rng(0).standard_normal(params, dtype=np.float32)}
    hub = NodeConfig(rank=0, world=world, topology="star", bind="127.0.0.1:0",
                     secret=SECRET.encode(), timeout=120.0).connect()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), str(world), hub.address,
                               SECRET, str(args.recycle)], stdout=subprocess.PIPE, text=True)
             for r in range(1, world)]
    load = os.getloadavg()
    print(f"# {params:,} float32 ({params * 4 / 1e6:.0f} MB) to {args.workers} workers, "
          f"{args.repeat} trials each way, workers recycling {args.recycle}; load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    times: dict[str, list[float]] = {"sequential": [], "concurrent": []}
    try:
        workers = hub.wait_for_workers(timeout=120)
        pool = GroupPool(hub)
        trial(pool, workers, state)  # warm-up: the workers' first bodies, the threads
        concurrent = _pool.CONCURRENT_BYTES
        for i in range(args.repeat):
            order = ("sequential", "concurrent") if i % 2 == 0 else ("concurrent",
                                                                      "sequential")
            for way in order:
                _pool.CONCURRENT_BYTES = 1 << 62 if way == "sequential" else concurrent
                times[way].append(trial(pool, workers, state))
                print(f"# trial {i + 1} {way}: {times[way][-1]:.3f} s "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
        _pool.CONCURRENT_BYTES = concurrent
        pool.stop_all(workers)
    finally:
        hub.close()
        usage = [proc.communicate(timeout=60)[0] for proc in procs]
    mb = params * 4 * args.workers / 1e6
    for way, seconds in times.items():
        print(f"{way}: {statistics.median(seconds):.3f} s ({min(seconds):.3f}-"
              f"{max(seconds):.3f}), {mb / statistics.median(seconds):.0f} MB/s")
    for rank, said in enumerate(usage, 1):
        fields = said.split()
        if len(fields) == 4:
            print(f"worker {rank}: {int(fields[1]):,} minor faults, user {float(fields[2]):.2f} s, "
                  f"system {float(fields[3]):.2f} s (every trial, both ways, and the warm-up)")
    ratios = [s / c for s, c in zip(times["sequential"], times["concurrent"])]
    print(f"sequential / concurrent per trial: {statistics.median(ratios):.2f}x "
          f"({min(ratios):.2f}-{max(ratios):.2f})")
    load = os.getloadavg()
    print(f"load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
