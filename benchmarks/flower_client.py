"""A Flower quickstart client under meshkit against the same client under Flower's own FedAvg.

Run (from the repository root, with Flower installed: ``pip install -e '.[flower]'``)::

    python benchmarks/flower_client.py                  # the numpy quickstart, 10 rounds
    python benchmarks/flower_client.py --client torch --trials 3

Both sides run the unchanged client of ``examples/flower/`` with the same
four partitions, run config (5 local epochs, learning rate 0.5), rounds and
seeds, every client sampled every round:

* **meshkit**: ``meshkit.run`` of ``examples/flower/meshkit.toml``'s config
  (the ``flower`` task, fedavg, ``workers`` local worker processes); a round's
  time is its ``seconds`` in ``metrics.jsonl`` (fits out to the workers and
  back, the fold, the coordinator's evaluation over every partition), and the
  figure is the median round after the first (round 1 holds each worker's
  first import of the client module: torch, for the torch client).
* **Flower** (the baseline): ``flwr.server.Server`` with ``FedAvg`` and one
  in-process ``ClientProxy`` per partition (``examples/flower/flower_server.py``;
  Flower's ``simulation`` would put each client in a Ray actor, and Ray is not
  installed here); the figure is ``Server.fit``'s own time over the rounds
  (fits on Flower's thread pool, aggregation, distributed evaluation on every
  client) divided by the rounds, all in this process with the client module
  already imported.

Every process runs torch on one thread (``OMP_NUM_THREADS=1``, set here before
torch loads, inherited by meshkit's workers), as Ray gives each of Flower's
simulated clients: on two shared cores, three processes each spinning two
OpenMP threads made a meshkit torch round 4 s instead of about 0.3 s.

Prints each side's final accuracy and loss (they must agree) and seconds per
round, and the ratio Flower / meshkit. A benchmark, not a test: it asserts
nothing; on a shared machine the times move with the load, so read the
spread over trials.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads; workers inherit it

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import meshkit  # noqa: E402
from meshkit.train import read_metrics  # noqa: E402

from examples.flower.flower_server import run_flower  # noqa: E402

RUN_CONFIG = {"local-epochs": 5, "learning-rate": 0.5}


def run_meshkit(module: str, rounds: int, workers: int, out: Path) -> dict:
    meshkit.run({
        "run": {"task": "flower", "seed": 0, "out": str(out)},
        "mesh": {"launch": "local", "workers": workers},
        "strategy": {"name": "federated", "rounds": rounds, "clients": 4},
        "task": {"app": f"examples.flower.{module}:client_fn", "num_partitions": 4,
                 "run_config": RUN_CONFIG},
    })
    rows = read_metrics(out)
    return {"accuracy": rows[-1]["accuracy"], "loss": rows[-1]["loss"],
            "round": statistics.median(r["seconds"] for r in rows[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--client", choices=("numpy", "torch"), default="numpy")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    module = f"quickstart_{args.client}"
    client_fn = getattr(__import__(f"examples.flower.{module}", fromlist=["client_fn"]),
                        "client_fn")
    ratios = []
    for trial in range(args.trials):
        with tempfile.TemporaryDirectory() as tmp:
            ours = run_meshkit(module, args.rounds, args.workers, Path(tmp) / "run")
        theirs = run_flower(client_fn, num_partitions=4, rounds=args.rounds,
                            run_config=RUN_CONFIG)
        theirs["round"] = theirs["seconds"] / args.rounds
        ratio = theirs["round"] / ours["round"]
        ratios.append(ratio)
        print(f"trial {trial + 1}: meshkit accuracy {ours['accuracy']:.4f} loss "
              f"{ours['loss']:.4f} {1000 * ours['round']:.1f} ms/round | "
              f"flower accuracy {theirs['accuracy']:.4f} loss {theirs['loss']:.4f} "
              f"{1000 * theirs['round']:.1f} ms/round | flower/meshkit "
              f"{ratio:.2f}x")
    print(f"flower/meshkit time per round: median {statistics.median(ratios):.2f}x "
          f"(min {min(ratios):.2f}, max {max(ratios):.2f}) over {args.trials} trials")


if __name__ == "__main__":
    main()
