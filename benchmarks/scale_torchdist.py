"""Data-parallel step time on torchdist against torch DDP (gloo), the same model, world 4.

Run (from the repository root, torch installed: ``pip install torch==2.13.0``)::

    python benchmarks/scale_torchdist.py                  # 4 replicas, 3 trials
    python benchmarks/scale_torchdist.py --replicas 2 --trials 1

Both sides train the 1.06M-parameter MLP of ``benchmarks/torch_overhead.py``
with SGD, each replica on its own shard, 32 rows a step, one torch thread per
process, on this machine's loopback:

* **DDP**: ``replicas`` spawned processes, ``init_process_group("gloo")``,
  ``DistributedDataParallel``; a step is zero_grad, forward, backward (DDP
  all-reduces the gradient buckets) and ``optimizer.step()``. Timed on rank 0
  over ``steps`` steps after a warm-up; the figure is the median step.
* **torchdist**: ``torchrun --standalone --nproc-per-node replicas+1 -m
  meshkit_torchdist CONFIG``: rank 0 is meshkit's coordinator, the other
  ``replicas`` ranks the replicas; data-parallel's ``step`` has every replica
  compute its gradients, average them with torch.distributed's all-reduce
  (``Group.mesh_all_reduce`` on the ``torchdist`` transport: rank 0 folds
  nothing) and apply them. A step's time is a round's ``seconds`` (from
  ``metrics.jsonl``) over its steps: it also carries the coordinator's
  request per step, the read-back of the model and the evaluation on 64 rows
  once per round (counted against meshkit). Round 1 (torch's warm-up) is
  left out.

Prints each side's median step and the throughput ratio DDP step / torchdist
step (target >= 0.8x, issue 16). A measurement, not a test: it asserts
nothing, and on a shared machine its figures move with the load.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from meshkit.train import free_ports

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

BATCH = 32



def _ddp_rank(rank: int, world: int, port: int, steps: int, out: object) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    import torch_overhead as bench

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        (x, y), _ = bench.data()
        size = len(x) // world
        xs = torch.from_numpy(x[rank * size:(rank + 1) * size])
        ys = torch.from_numpy(y[rank * size:(rank + 1) * size])
        torch.manual_seed(0)
        model = DistributedDataParallel(bench.model())
        optimizer = torch.optim.SGD(model.parameters(), lr=bench.LR)
        loss_fn = nn.CrossEntropyLoss()
        rng = np.random.default_rng(rank)
        times = []
        for i in range(steps + 3):
            rows = torch.from_numpy(np.sort(rng.choice(size, BATCH, replace=False)))
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(xs[rows]), ys[rows]).backward()
            optimizer.step()
            if i >= 3:
                times.append(time.perf_counter() - start)
        if rank == 0:
            out.put(times)
    finally:
        dist.destroy_process_group()


def ddp(replicas: int, steps: int) -> list[float]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_ports(1)[0]
    procs = [ctx.Process(target=_ddp_rank, args=(r, replicas, port, steps, out))
             for r in range(replicas)]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=600)
    finally:
        for p in procs:
            p.join(60)


CONFIG = """
[run]
task = "torch_overhead:task"
seed = 0
out = "{out}"

[mesh]
transport = "torchdist"
workers = {replicas}
timeout = 120

[strategy]
name = "data-parallel"
rounds = {rounds}
steps = {steps}
batch_size = {batch}

[aggregator]
name = "allreduce"

[task]
lr = 0.01
device = "cpu"
threads = 1
"""


def torchdist(replicas: int, steps: int, rounds: int) -> list[float]:
    from meshkit.train import read_metrics

    torchrun = Path(sys.executable).with_name("torchrun")
    command = str(torchrun) if torchrun.exists() else shutil.which("torchrun") or "torchrun"
    with tempfile.TemporaryDirectory(prefix="scale-torchdist-") as tmp:
        config = Path(tmp) / "run.toml"
        config.write_text(CONFIG.format(out=Path(tmp) / "run", replicas=replicas,
                                        rounds=rounds + 1, steps=steps, batch=BATCH))
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (str(HERE),
                                                         os.environ.get("PYTHONPATH", "")) if p)}
        subprocess.run([command, "--standalone", "--nproc-per-node", str(replicas + 1), "-m",
                        "meshkit_torchdist", str(config)], check=True, env=env, cwd=tmp,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=1800)
        rows = read_metrics(Path(tmp) / "run")
    return [float(r["seconds"]) / steps for r in rows[1:]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="steps per round / timed DDP steps")
    parser.add_argument("--rounds", type=int, default=3, help="timed torchdist rounds")
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"{args.replicas} replicas, batch {BATCH} each, 1.06M-parameter MLP, "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    ratios, ddp_all, dist_all = [], [], []
    for trial in range(1, args.trials + 1):
        base = ddp(args.replicas, args.steps * args.rounds)
        ours = torchdist(args.replicas, args.steps, args.rounds)
        b, o = statistics.median(base), statistics.median(ours)
        ratios.append(b / o)
        ddp_all += base
        dist_all += ours
        print(f"trial {trial}: DDP {b * 1e3:7.2f} ms/step   torchdist {o * 1e3:7.2f} ms/step "
              f"(rounds {', '.join(f'{t * 1e3:.1f}' for t in ours)})   throughput ratio "
              f"{b / o:.2f}x", flush=True)
    print(f"all trials: DDP median {statistics.median(ddp_all) * 1e3:.2f} ms/step, torchdist "
          f"median {statistics.median(dist_all) * 1e3:.2f} ms/step; throughput ratio "
          f"{statistics.median(ddp_all) / statistics.median(dist_all):.2f}x (per trial "
          f"{min(ratios):.2f}..{max(ratios):.2f}x); target >= 0.8x; load now "
          f"{os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
