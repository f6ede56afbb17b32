"""Asynchronous (fedbuff) against synchronous (federated) training: time to accuracy.

Run (from the repository root, in the dev venv; the plot needs the ``plot`` extra)::

    python benchmarks/async.py                       # the virtual-clock figure + plot
    python benchmarks/async.py --seeds 0 1 2         # its spread over seeds
    python benchmarks/async.py --real                # also: four real nodes, one 5x slower
    python benchmarks/async.py --real-only           # only that

**Virtual clock** (issue 27's figure). 64 clients of ``digits`` split by a
Dirichlet(α = 0.5) partitioner, each with a fixed fit duration drawn from
lognormal(σ = 1) (median 1 simulated second; :mod:`meshkit.simulation`).
The baseline is synchronous ``federated``: each round samples ``--fraction``
of the clients and lasts as long as its slowest client (the simulated time
of a round is the largest duration among its clients). ``fedbuff`` runs on
the same clients, durations, task, partitioner and outer optimizer with
``[simulation] clock = "virtual"``. Both run in this process through
:class:`meshkit.train.LocalPool` (the strategies' own code; on the virtual
clock fedbuff's result does not depend on the pool). Printed: simulated
seconds and client updates until held-out accuracy first reaches
``--target`` (0.95), and the ratios fedbuff / federated. Goal: time ratio
<= 1/3 with updates ratio <= 1.5.

**Real processes** (``--real``): a coordinator and four ``meshkit node``
processes on loopback, one of them five times slower (``--task-option
fit_delay`` 5x the others'); wall seconds until the run's accuracy first
reaches ``--real-target``, for fedbuff and for federated (every round waits
for the slow node). Wall time depends on the machine and its load: this is
a benchmark, it asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import meshkit.plugins
from meshkit.simulation import Speeds
from meshkit.train import LocalPool, StrategyContext, Trainer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the nodes and the run they serve: tests/support/nodes.py

from tests.support.nodes import run_with_nodes, spawn_node  # noqa: E402


def task_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"hidden": args.hidden, "lr": args.lr, "epochs": args.epochs, "batch_size": 16}


def context(args: argparse.Namespace, seed: int, speeds: Speeds | None) -> StrategyContext:
    task = meshkit.plugins.create("task", "digits", task_options(args))
    partitioner = meshkit.plugins.create("partitioner", "dirichlet", {"alpha": args.alpha})
    ranks = [1, 2, 3, 4]
    trainers = {r: Trainer(meshkit.plugins.create("task", "digits", task_options(args)),
                           partitioner=partitioner, partitioner_name="dirichlet", seed=seed)
                for r in ranks}
    return StrategyContext(
        task=task, aggregator=meshkit.plugins.create("aggregator", "fedavg"),
        pool=LocalPool(trainers), workers=ranks, rng=np.random.default_rng(seed), seed=seed,
        outer=meshkit.plugins.create("outer_optimizer", args.outer, outer_options(args)),
        outer_name=args.outer, partitioner=partitioner, speeds=speeds)


def outer_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"lr": args.server_lr} if args.outer != "average" else {}


def curve(ctx: StrategyContext, strategy: Any, speeds: Speeds) -> list[tuple[float, int, float]]:
    """(simulated seconds, client updates, accuracy) after every round or server step."""
    points: list[tuple[float, int, float]] = []
    clock = [0.0]
    updates = [0]

    def on_round(report: Any, state: Any) -> None:
        if report.simulated_time is not None:
            clock[0] = report.simulated_time
        else:  # synchronous: the round lasts as long as its slowest client
            clock[0] += max(speeds.duration(c) for c in report.clients)
        updates[0] += len(report.clients)
        points.append((clock[0], updates[0], float(report.metrics["accuracy"])))
    ctx.on_round = on_round
    strategy.run(ctx)
    return points


def first_reach(points: list[tuple[float, int, float]], target: float
                ) -> tuple[float, int] | None:
    for seconds, updates, accuracy in points:
        if accuracy >= target:
            return seconds, updates
    return None


def virtual(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    speeds = Speeds(seed=seed, sigma=args.sigma)
    sync = meshkit.plugins.create("strategy", "federated", {
        "rounds": args.rounds, "clients": args.clients, "fraction": args.fraction})
    sync_points = curve(context(args, seed, None), sync, speeds)
    buff = meshkit.plugins.create("strategy", "fedbuff", {
        "rounds": args.steps, "clients": args.clients, "buffer_size": args.buffer_size,
        "concurrency": args.concurrency, "staleness": args.staleness})
    buff_points = curve(context(args, seed, speeds), buff, speeds)
    return {"seed": seed, "federated": sync_points, "fedbuff": buff_points,
            "sync_hit": first_reach(sync_points, args.target),
            "buff_hit": first_reach(buff_points, args.target)}


def plot(results: list[dict[str, Any]], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, result in enumerate(results):
        for name, colour in (("federated", "tab:blue"), ("fedbuff", "tab:orange")):
            points = result[name]
            ax.plot([p[0] for p in points], [p[2] for p in points], color=colour,
                    alpha=1.0 if i == 0 else 0.35,
                    label=f"{name} (synchronous)" if i == 0 and name == "federated"
                    else (name if i == 0 else None))
    ax.axhline(target, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("simulated seconds (virtual clock)")
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(0.5, 1.0)
    ax.set_title("digits, 64 clients, Dirichlet 0.5, lognormal(1) speeds")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- real processes -------------------------------------------------------------------


def real_run(strategy: str, args: argparse.Namespace, workdir: Path) -> list[tuple[float, float]]:
    """(wall seconds since the first round began, accuracy) per round of a run on four
    real nodes, rank 4 five times slower."""
    from meshkit.train import read_metrics

    secret = workdir / "secret"
    secret.write_bytes(b"async-benchmark-secret-0123456789\n")
    secret.chmod(0o600)
    extra = (f"buffer_size = {args.real_buffer}\nconcurrency = 4\nclients = 16\n"
             if strategy == "fedbuff" else "clients = 16\nfraction = 0.25\n")
    rounds = args.real_steps if strategy == "fedbuff" else args.real_rounds
    config = workdir / f"{strategy}.toml"
    config.write_text(f"""
[run]
task = "digits"
seed = 1
out = "{workdir / strategy}"

[mesh]
launch = "external"
workers = 4
secret_file = "{secret}"
timeout = 30

[strategy]
name = "{strategy}"
rounds = {rounds}
{extra}
[task]
fit_delay = {args.delay}
epochs = {args.epochs}
""")
    def nodes(address: str) -> list[subprocess.Popen]:
        return [spawn_node(rank, 5, address, secret, "--task-option",
                           f"fit_delay={args.delay * (5 if rank == 4 else 1)}")
                for rank in (1, 2, 3, 4)]

    run_with_nodes(config, nodes, timeout=600)
    points, wall = [], 0.0
    for row in read_metrics(workdir / strategy):
        wall += float(row["seconds"])
        points.append((wall, float(row["accuracy"])))
    return points


def real(args: argparse.Namespace) -> None:
    print(f"\nreal processes: four nodes, rank 4 five times slower (fit_delay {args.delay:g} s "
          f"vs {5 * args.delay:g} s); wall seconds to accuracy >= {args.real_target}")
    with tempfile.TemporaryDirectory() as tmp:
        found = {}
        for strategy in ("federated", "fedbuff"):
            points = real_run(strategy, args, Path(tmp))
            hit = next((w for w, acc in points if acc >= args.real_target), None)
            found[strategy] = hit
            print(f"  {strategy:9s}: {len(points)} rounds/steps, final accuracy "
                  f"{points[-1][1]:.3f}, reached target after "
                  + (f"{hit:.2f} s" if hit is not None else "never"))
        if found["federated"] and found["fedbuff"]:
            print(f"  ratio fedbuff / federated wall time: "
                  f"{found['fedbuff'] / found['federated']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--fraction", type=float, default=0.25)
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--buffer-size", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--staleness", default="sqrt")
    parser.add_argument("--outer", default="average")
    parser.add_argument("--server-lr", type=float, default=1.0)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "async-curve.png")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--real", action="store_true")
    parser.add_argument("--real-only", action="store_true", help="skip the virtual clock")
    parser.add_argument("--delay", type=float, default=0.05)
    parser.add_argument("--real-target", type=float, default=0.9)
    parser.add_argument("--real-rounds", type=int, default=20)
    parser.add_argument("--real-steps", type=int, default=40)
    parser.add_argument("--real-buffer", type=int, default=2)
    args = parser.parse_args()
    if args.real_only:
        real(args)
        return

    print(f"virtual clock: {args.clients} clients, digits, Dirichlet alpha = {args.alpha}, "
          f"lognormal(sigma = {args.sigma}) durations; target accuracy {args.target}")
    print(f"  federated: fraction {args.fraction} per round; fedbuff: K = {args.buffer_size}, "
          f"concurrency {args.concurrency}, staleness {args.staleness}; outer {args.outer}")
    results = []
    time_ratios, update_ratios = [], []
    for seed in args.seeds:
        started = time.perf_counter()
        result = virtual(args, seed)
        results.append(result)
        sync, buff = result["sync_hit"], result["buff_hit"]
        line = f"  seed {seed}: "
        line += (f"federated {sync[0]:8.1f} s, {sync[1]:5d} updates" if sync
                 else f"federated never (best {max(p[2] for p in result['federated']):.3f})")
        line += " | "
        line += (f"fedbuff {buff[0]:8.1f} s, {buff[1]:5d} updates" if buff
                 else f"fedbuff never (best {max(p[2] for p in result['fedbuff']):.3f})")
        if sync and buff:
            time_ratios.append(buff[0] / sync[0])
            update_ratios.append(buff[1] / sync[1])
            line += (f" | time ratio {time_ratios[-1]:.3f}, updates ratio "
                     f"{update_ratios[-1]:.2f}")
        print(line + f"  ({time.perf_counter() - started:.0f} s)")
    if time_ratios:
        spread = (f" (min {min(time_ratios):.3f}, max {max(time_ratios):.3f})"
                  if len(time_ratios) > 1 else "")
        print(f"  median time ratio fedbuff / federated: {statistics.median(time_ratios):.3f}"
              f"{spread}; median updates ratio {statistics.median(update_ratios):.2f} "
              f"(goal: <= 0.333 with <= 1.5)")
    if not args.no_plot:
        plot(results, args.target, args.plot)
        print(f"  plot: {args.plot}")
    if args.real:
        real(args)


if __name__ == "__main__":
    main()
