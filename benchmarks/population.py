"""A population of 100,000 clients, 100 a round: meshkit against Flower's simulation (issue 22).

Run (from the repository root, in the dev venv; Flower's side needs
``pip install "flwr[simulation]==1.42.*"``)::

    python benchmarks/population.py                         # the figure: N = 100,000, 1,000 rounds
    python benchmarks/population.py --rounds 50 --flat      # quick, plus cost per round at 10k/100k/1M
    python benchmarks/population.py --skip-flower --rounds 20 --clients 1000   # a smoke run
    python benchmarks/population.py --flat-only --rounds 40 --trials 2   # sizes interleaved

The job: ``synthetic-federated`` with alpha = beta = 1 (LEAF's
synthetic(1, 1): 60 features, 10 classes, LEAF's per-client counts), its
default MLP (60 -> 32 -> 10, one epoch of batch-32 SGD per fit), ``fedavg``,
100 clients sampled per round with the run seed, the coordinator evaluating
the new model every round on the pooled held-out rows of 20 clients.

* **meshkit**: ``meshkit.run`` of that config with ``workers`` local worker
  processes (``[run] progress_every = 100``, ``client_metrics = "file"``).
  Wall time is the whole run, the workers' start included; per round is
  the median ``seconds`` of ``metrics.jsonl`` (with its quartiles).
* **Flower** (the baseline): Flower 1.42's simulation (``run_simulation``,
  Ray backend, ``num_supernodes = N``, one CPU per client actor so two
  actors on two cores), ``FedAvg(fraction_train = 100 / N)`` with the same
  ``evaluate_fn``; the ClientApp fits the very same task on the very same
  client rows (``client_data(partition-id)``). It runs in a subprocess for
  as long as meshkit's whole run took (``--flower-seconds`` to change it)
  and is then stopped; per round is the median gap between its
  ``evaluate_fn`` calls, after the first round.

Printed: wall time, client updates per second, each side's peak memory of
all its processes (the sum of the resident sets of the process tree,
sampled every 0.2 s: coordinator, workers; Flower's driver, Ray and its
actors), seconds per round, and the ratio Flower / meshkit per round. With
``--flat``: meshkit's per-round time and peak memory at 10k, 100k and 1M
clients (100 a round) -- a population is described, not materialised, so
both should not grow with N.

A benchmark, not a test: it asserts nothing; on a loaded machine the times
move with the load (read the quartiles).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
COHORT = 100


# -- memory of a process tree ------------------------------------------------------------

def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class TreeMemory:
    """The peak over time of the summed resident set of ``pid`` and its descendants."""

    def __init__(self, pid: int, every: float = 0.2) -> None:
        self.pid, self.every, self.peak = pid, every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "TreeMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            tree = _children()
            pids, todo = [], [self.pid]
            while todo:
                pid = todo.pop()
                pids.append(pid)
                todo.extend(tree.get(pid, []))
            self.peak = max(self.peak, sum(_rss(p) for p in pids))


# -- meshkit -----------------------------------------------------------------------------

def task_options(clients: int) -> dict[str, Any]:
    return {"clients": clients, "alpha": 1.0, "beta": 1.0, "eval_clients": 20}


def write_config(path: Path, out: Path, *, clients: int, rounds: int, workers: int) -> Path:
    options = "\n".join(f"{k} = {json.dumps(v)}" for k, v in task_options(clients).items())
    path.write_text(textwrap.dedent(f"""
        [run]
        task = "synthetic-federated"
        seed = 0
        out = "{out}"
        progress_every = 100
        client_metrics = "file"

        [mesh]
        launch = "local"
        workers = {workers}

        [strategy]
        name = "federated"
        rounds = {rounds}
        fraction = {COHORT / clients!r}

        [aggregator]
        name = "fedavg"

        [outer_optimizer]
        name = "average"

        [task]
    """) + options + "\n")
    return path


def run_meshkit(clients: int, rounds: int, workers: int, tmp: Path) -> dict[str, Any]:
    import meshkit
    from meshkit.train import read_metrics

    out = tmp / f"meshkit-{clients}"
    config = write_config(tmp / f"population-{clients}.toml", out, clients=clients,
                          rounds=rounds, workers=workers)
    started = time.perf_counter()
    with TreeMemory(os.getpid()) as memory:
        report = meshkit.run(str(config), overwrite=True)
    wall = time.perf_counter() - started
    if report.error:
        raise SystemExit(f"meshkit run failed: {report.error}")
    rows = read_metrics(out)
    seconds = [float(r["seconds"]) for r in rows[1:]] or [float(rows[0]["seconds"])]
    return {"side": "meshkit", "clients": clients, "rounds": len(rows), "wall": wall,
            "updates_per_second": len(rows) * COHORT / wall, "peak_bytes": memory.peak,
            "round": _spread(seconds), "accuracy": rows[-1].get("accuracy")}


def _spread(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    q = statistics.quantiles(values, n=4) if len(values) >= 2 else [values[0]] * 3
    return {"median": statistics.median(values), "q1": q[0], "q3": q[2],
            "min": values[0], "max": values[-1]}


# -- Flower ------------------------------------------------------------------------------

def flower_child(clients: int, rounds: int, progress: str) -> None:
    """Flower 1.42's simulation of the same job (run in a subprocess, stopped from outside)."""
    import numpy as np
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    sys.path.insert(0, str(ROOT / "plugins"))
    from meshkit.task import create_task

    task = create_task("synthetic-federated", task_options(clients))
    keys = sorted(task.init_state(0))
    client_app = ClientApp()

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        client = int(context.node_config["partition-id"])
        arrays = msg.content["arrays"].to_numpy_ndarrays()
        state = dict(zip(keys, arrays))
        x, y = task.client_data(client)
        fit = task.fit(state, x, y, seed=int(msg.content["config"]["server-round"]) * 1_000_003
                       + client)
        content = RecordDict({
            "arrays": ArrayRecord([np.asarray(fit.state[k]) for k in keys]),
            "metrics": MetricRecord({"num-examples": int(fit.examples),
                                     "train_loss": float(fit.metrics["train_loss"])})})
        return Message(content=content, reply_to=msg)

    server_app = ServerApp()
    log = open(progress, "a", buffering=1)

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        state = dict(zip(keys, arrays.to_numpy_ndarrays()))
        metrics = task.evaluate(state)
        log.write(json.dumps({"round": server_round, "t": time.perf_counter(), **metrics}) + "\n")
        return MetricRecord(metrics)

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = FedAvg(fraction_train=COHORT / clients, fraction_evaluate=0.0,
                          min_train_nodes=COHORT, min_evaluate_nodes=0,
                          min_available_nodes=COHORT)
        initial = ArrayRecord([task.init_state(0)[k] for k in keys])
        strategy.start(grid=grid, initial_arrays=initial, num_rounds=rounds,
                       evaluate_fn=evaluate)

    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": 2, "include_dashboard": False}})


def run_flower(clients: int, rounds: int, budget: float, tmp: Path) -> dict[str, Any]:
    progress = tmp / "flower-progress.jsonl"
    progress.write_text("")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'plugins'}",
           "RAY_DEDUP_LOGS": "0", "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--flower-child", "--clients",
                             str(clients), "--rounds", str(rounds), "--progress", str(progress)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, text=True)
    with TreeMemory(proc.pid) as memory:
        try:
            proc.wait(timeout=budget)
            finished = True
        except subprocess.TimeoutExpired:
            finished = False
            os.killpg(proc.pid, 9)
            proc.wait()
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in progress.read_text().splitlines() if line]
    trained = [r for r in rows if r["round"] >= 1]
    times = [r["t"] for r in rows]
    gaps = [b - a for a, b in zip(times[1:], times[2:])] or (
        [times[1] - times[0]] if len(times) > 1 else [])
    if not gaps:
        err = proc.stderr.read()[-2000:] if proc.stderr else ""
        raise SystemExit(f"Flower finished no round in {wall:.0f} s\n{err}")
    return {"side": "flower", "clients": clients, "rounds": len(trained), "wall": wall,
            "finished": finished, "updates_per_second": len(trained) * COHORT / wall,
            "peak_bytes": memory.peak, "round": _spread(gaps),
            "accuracy": trained[-1].get("accuracy") if trained else None}


# -- the report --------------------------------------------------------------------------

def _line(r: dict[str, Any]) -> str:
    spread = r["round"]
    return (f"{r['side']:>8}  N={r['clients']:>9,}  rounds {r['rounds']:>5}  wall "
            f"{r['wall']:7.1f} s  {r['updates_per_second']:7.0f} updates/s  peak "
            f"{r['peak_bytes'] / 2**20:7.0f} MiB  round {spread['median'] * 1e3:7.1f} ms "
            f"[{spread['q1'] * 1e3:.1f}-{spread['q3'] * 1e3:.1f}]  accuracy "
            f"{r['accuracy'] if r['accuracy'] is None else round(r['accuracy'], 4)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--skip-flower", action="store_true")
    parser.add_argument("--flower-seconds", type=float, default=0.0,
                        help="how long Flower may run (default: meshkit's wall time)")
    parser.add_argument("--flat", action="store_true",
                        help="also meshkit's cost per round at 10k, 100k and 1M clients")
    parser.add_argument("--flat-only", action="store_true", help="only the --flat cells")
    parser.add_argument("--trials", type=int, default=1,
                        help="--flat: cycles over the three sizes, interleaved (load drifts)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--flower-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--progress", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.flower_child:
        flower_child(args.clients, args.rounds, args.progress)
        return
    sys.path.insert(0, str(ROOT))
    results = []
    with tempfile.TemporaryDirectory(prefix="meshkit-population-") as tmp:
        mesh = None
        if not args.flat_only:
            mesh = run_meshkit(args.clients, args.rounds, args.workers, Path(tmp))
            results.append(mesh)
            print(_line(mesh), flush=True)
        if mesh is not None and not args.skip_flower:
            flower = run_flower(args.clients, args.rounds,
                                args.flower_seconds or mesh["wall"], Path(tmp))
            results.append(flower)
            print(_line(flower), flush=True)
            print(f"ratio Flower / meshkit per round: "
                  f"{flower['round']['median'] / mesh['round']['median']:.1f}x "
                  f"(Flower ran {flower['rounds']} of {args.rounds} rounds in the same "
                  f"{flower['wall']:.0f} s)")
        if args.flat or args.flat_only:
            flat_rounds = min(args.rounds, 100)
            medians: dict[int, list[float]] = {}
            for _ in range(args.trials):
                for n in (10_000, 100_000, 1_000_000):
                    r = run_meshkit(n, flat_rounds, args.workers, Path(tmp))
                    results.append({**r, "side": "flat"})
                    medians.setdefault(n, []).append(r["round"]["median"])
                    print(_line({**r, "side": "flat"}), flush=True)
            base = statistics.median(medians[100_000])
            print("per round, median of trials: " + ", ".join(
                f"N={n:,} {statistics.median(m) * 1e3:.1f} ms "
                f"({statistics.median(m) / base:.2f}x of 100k)" for n, m in medians.items()))
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
