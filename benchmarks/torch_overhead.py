"""What a federated round of a torch model costs through meshkit, against torch alone.

Run (from the repository root, with torch installed: ``pip install torch==2.13.0``
then ``pip install -e '.[torch]'``)::

    python benchmarks/torch_overhead.py                 # 1.06M-parameter MLP, 2 workers
    python benchmarks/torch_overhead.py --trials 5

Both sides do the same work in the same number of processes, each with one
torch thread:

* **torch alone**: ``workers`` processes (spawned, torch imported, one
  untimed warm-up fit), each running the same fit as the task does — a
  fresh SGD optimizer, one epoch over its shard of the data in minibatches of
  32, the batches drawn by the same seeded sampler — started together at a
  barrier; a round is the slowest process's time.
* **meshkit**: ``meshkit.run`` of a federated config with ``workers`` local
  workers, one client each, fedavg and the ``average`` outer optimizer, this
  module's ``task`` (:func:`meshkit.torch.task`). A round is the
  ``seconds`` the run records for it in ``metrics.jsonl``: the fit requests
  with the model (4.2 MB) out to every worker, the fits, the models back,
  the fold, and the coordinator's evaluation (on 64 held-out rows: small, and
  counted against meshkit). Round 1 holds each worker's torch warm-up and is
  left out.

Prints the median round of each and the ratio meshkit / torch (target
<= 1.15x at a 1M-parameter model, issue 15), per trial and over all trials.
This is a benchmark, not a test: it asserts nothing, and on a shared machine
its figures move with the load; run several trials and read the spread.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

import meshkit.torch
from meshkit.train import read_metrics

HERE = Path(__file__).resolve().parent
FEATURES, HIDDEN, WIDTH, CLASSES = 256, 1024, 768, 10
ROWS, TEST_ROWS, BATCH, LR = 4096, 64, 32, 0.01


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, WIDTH),
                         nn.ReLU(), nn.Linear(WIDTH, CLASSES))


def data():
    """Seeded synthetic rows with learnable labels (a fixed random projection)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS + TEST_ROWS, FEATURES), dtype=np.float32)
    y = (x @ rng.standard_normal((FEATURES, CLASSES), dtype=np.float32)).argmax(1)
    return (x[:ROWS], y[:ROWS]), (x[ROWS:], y[ROWS:])


task = meshkit.torch.task(model=model, loss=nn.CrossEntropyLoss(), data=data,
                          name="torch-overhead")


# -- torch alone -----------------------------------------------------------------


def _direct_fit(net: nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int) -> None:
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    dataset = TensorDataset(x, y)
    sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))
    loss_fn = nn.CrossEntropyLoss()
    for inputs, targets in DataLoader(dataset, sampler=BatchSampler(sampler, BATCH, False),
                                      batch_size=None):
        optimizer.zero_grad(set_to_none=True)
        loss_fn(net(inputs), targets).backward()
        optimizer.step()


def _direct_worker(rank: int, workers: int, rounds: int, barrier, out) -> None:
    torch.set_num_threads(1)
    (x, y), _ = data()
    size = ROWS // workers
    xs = torch.from_numpy(x[rank * size:(rank + 1) * size])
    ys = torch.from_numpy(y[rank * size:(rank + 1) * size])
    torch.manual_seed(0)
    net = model()
    _direct_fit(net, xs, ys, seed=0)  # warm-up, as meshkit's round 1
    for r in range(rounds):
        barrier.wait()
        start = time.perf_counter()
        _direct_fit(net, xs, ys, seed=r + 1)
        out.put((r, time.perf_counter() - start))


def torch_alone(workers: int, rounds: int) -> list[float]:
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(workers), ctx.Queue()
    procs = [ctx.Process(target=_direct_worker, args=(r, workers, rounds, barrier, out))
             for r in range(workers)]
    for p in procs:
        p.start()
    times: dict[int, float] = {}
    for _ in range(workers * rounds):
        r, seconds = out.get(timeout=600)
        times[r] = max(times.get(r, 0.0), seconds)
    for p in procs:
        p.join(timeout=60)
    return [times[r] for r in range(rounds)]


# -- meshkit ---------------------------------------------------------------------------


CONFIG = """
[run]
task = "torch_overhead:task"
seed = 0
out = "{out}"

[mesh]
launch = "local"
workers = {workers}

[strategy]
name = "federated"
rounds = {rounds}
clients = {workers}
fraction = 1.0

[aggregator]
name = "fedavg"

[outer_optimizer]
name = "average"

[task]
lr = {lr}
epochs = 1
batch_size = {batch}
device = "cpu"
threads = 1
"""


def through_meshkit(workers: int, rounds: int) -> list[float]:
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="torch-overhead-") as tmp:
        config = Path(tmp) / "run.toml"
        config.write_text(CONFIG.format(out=Path(tmp) / "run", workers=workers,
                                        rounds=rounds + 1, lr=LR, batch=BATCH))
        meshkit.run(str(config))
        rows = read_metrics(Path(tmp) / "run")
    return [float(r["seconds"]) for r in rows[1:]]  # round 1: the workers' warm-up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per trial")
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    params = sum(p.numel() for p in model().parameters())
    steps = -(-(ROWS // args.workers) // BATCH)
    print(f"model: {params / 1e6:.2f}M float32 parameters; {args.workers} workers, "
          f"{steps} SGD steps of {BATCH} per round each; torch {torch.__version__}, "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    ratios, alone_all, mesh_all = [], [], []
    for trial in range(1, args.trials + 1):
        alone = torch_alone(args.workers, args.rounds)
        mesh = through_meshkit(args.workers, args.rounds)
        a, m = statistics.median(alone), statistics.median(mesh)
        ratios.append(m / a)
        alone_all += alone
        mesh_all += mesh
        print(f"trial {trial}: torch alone {a * 1e3:7.1f} ms/round "
              f"(min {min(alone) * 1e3:.1f}, max {max(alone) * 1e3:.1f})   meshkit "
              f"{m * 1e3:7.1f} ms/round (min {min(mesh) * 1e3:.1f}, max {max(mesh) * 1e3:.1f})"
              f"   ratio {m / a:.3f}x")
    print(f"all trials: torch alone median {statistics.median(alone_all) * 1e3:.1f} ms, "
          f"meshkit median {statistics.median(mesh_all) * 1e3:.1f} ms; ratio "
          f"{statistics.median(mesh_all) / statistics.median(alone_all):.3f}x (per trial "
          f"{min(ratios):.3f}..{max(ratios):.3f}x); target <= 1.15x")


if __name__ == "__main__":
    main()
