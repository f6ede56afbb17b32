"""A private round against the same round without ``[privacy]``: time and bytes, interleaved.

Run (from the repository root)::

    python benchmarks/dp_round.py                        # digits and 1M parameters, 3 trials
    python benchmarks/dp_round.py --workload digits --trials 5

Each trial runs, in an order that rotates from trial to trial, the same
``federated`` job (same seed, so the same Poisson cohorts) three ways, by
``meshkit.run`` with two local worker processes over TCP on loopback:

* ``plain``: no ``[privacy]`` (fedavg; the batched round, one exact partial
  per worker);
* ``dp``: ``[privacy] name = "dp-fixed"`` (S = 1, z = 1, seeded noise): the
  private round folded per worker (each worker clips and sums its clients'
  updates, the coordinator clips each partial and adds the noise once);
* ``dp-flat``: the same private round forced down the per-client path (the
  engine's ``batch_applies`` patched to refuse), as every private round was
  played before: each client's model crosses to the coordinator alone.

Per run: the median over rounds (the first round left out: it warms the
workers) of the round's wall time (``seconds`` of metrics.jsonl) and of its
bytes (``bytes_up + bytes_down``, counted by the transport: every frame
body, both ways). Reported per variant: the median over trials with (min–max),
and each private variant's ratio to ``plain`` (ratio of the medians).

``--cpu`` measures the same three variants in one process instead
(``LocalPool``: the workers' trainers called in-process, no transport), round
by round, the variants interleaved within each round, as CPU time
(``time.process_time``: the coordinator's and the workers' work together,
and nothing of other processes'). On a shared, loaded machine wall times of
separate runs swing by 3×; the CPU a round costs does not.

Workloads: ``digits`` (the shipped numpy MLP, 2,410 float64 parameters;
1,000 clients, q = 0.05, about 50 a round) and ``1m`` (the same task with
``hidden = 13333``: 1,000,295 float64 parameters; 200 clients, q = 0.1,
about 20 a round). A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import meshkit  # noqa: E402
from meshkit.train import read_metrics  # noqa: E402
from meshkit.train._rounds import engine as _engine  # noqa: E402

WORKLOADS: dict[str, dict[str, Any]] = {
    "digits": {"task": {"lr": 0.5}, "clients": 1000, "fraction": 0.05},
    "1m": {"task": {"lr": 0.05, "hidden": 13333}, "clients": 200, "fraction": 0.1},
}
VARIANTS = ("plain", "dp", "dp-flat")


@contextlib.contextmanager
def _flat() -> Iterator[None]:
    """The per-client private round (the path before): the batched round refused."""
    batch_applies = _engine.batch_applies
    _engine.batch_applies = lambda *a, **k: False  # type: ignore[assignment]
    try:
        yield
    finally:
        _engine.batch_applies = batch_applies


def run_one(workload: str, variant: str, rounds: int, seed: int, out: Path) -> dict[str, float]:
    spec = WORKLOADS[workload]
    config: dict[str, Any] = {
        "run": {"task": "digits", "seed": seed, "out": str(out)},
        "mesh": {"launch": "local", "workers": 2, "transport": "tcp", "timeout": 600.0},
        "strategy": {"name": "federated", "rounds": rounds, "clients": spec["clients"],
                     "fraction": spec["fraction"], "sampling": "poisson"},
        "task": dict(spec["task"]),
    }
    if variant != "plain":
        config["privacy"] = {"name": "dp-fixed", "clip_norm": 1.0, "noise_multiplier": 1.0,
                             "noise": "seeded"}
    with _flat() if variant == "dp-flat" else contextlib.nullcontext():
        meshkit.run(config)
    rows = read_metrics(out)[1:]  # the first round warms the workers up
    return {"seconds": statistics.median(float(r["seconds"]) for r in rows),
            "bytes": statistics.median(float(r["bytes_up"] + r["bytes_down"]) for r in rows)}


def cpu_rounds(workload: str, rounds: int, seed: int) -> dict[str, list[float]]:
    """CPU seconds of each round, per variant, in-process, interleaved round by round."""
    import numpy as np

    from meshkit.train import LocalPool, StrategyContext

    spec = WORKLOADS[workload]

    def task() -> Any:
        return meshkit.plugins.create("task", "digits", spec["task"])

    def context(variant: str) -> Any:
        privacy = None if variant == "plain" else meshkit.plugins.create(
            "privacy", "dp-fixed", {"clip_norm": 1.0, "noise_multiplier": 1.0,
                                    "noise": "seeded"})
        return StrategyContext(
            task=task(), aggregator=meshkit.plugins.create("aggregator", "fedavg"),
            pool=LocalPool.of(task, (1, 2)), workers=[1, 2],
            rng=np.random.default_rng(seed), seed=seed, privacy=privacy,
            outer=meshkit.plugins.create("outer_optimizer", "average"))

    federated = meshkit.plugins.create("strategy", "federated", {
        "rounds": rounds, "clients": spec["clients"], "fraction": spec["fraction"],
        "sampling": "poisson"})
    contexts = {v: context(v) for v in VARIANTS}
    state = contexts["plain"].task.init_state(seed)
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for rnd in range(1, rounds + 1):
        shift = rnd % len(VARIANTS)
        for variant in VARIANTS[shift:] + VARIANTS[:shift]:
            with _flat() if variant == "dp-flat" else contextlib.nullcontext():
                start = time.process_time()
                federated.play_round(contexts[variant], rnd, state)
                cpu[variant].append(time.process_time() - start)
    return cpu


def _spread(values: list[float], scale: float = 1.0, fmt: str = "{:.3f}") -> str:
    return (fmt.format(statistics.median(values) * scale) + " ("
            + fmt.format(min(values) * scale) + "–" + fmt.format(max(values) * scale) + ")")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), nargs="+",
                        default=["digits", "1m"])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--cpu", action="store_true",
                        help="CPU per round in one process, interleaved (module docstring)")
    args = parser.parse_args()
    if args.cpu:
        for workload in args.workload:
            loads = os.getloadavg()[0]
            cpu = cpu_rounds(workload, args.rounds, seed=0)
            print(f"\n{workload}: CPU per round in-process, {args.rounds} rounds interleaved, "
                  f"load average {loads:.1f}–{os.getloadavg()[0]:.1f}")
            print("| variant | CPU a round, ms | vs plain |")
            print("|---|---|---|")
            for variant in VARIANTS:
                ratio = statistics.median(cpu[variant]) / statistics.median(cpu["plain"])
                print(f"| {variant} | {_spread(cpu[variant], 1e3, '{:.1f}')} | {ratio:.2f}× |",
                      flush=True)
        return
    print(f"start {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for workload in args.workload:
        figures: dict[str, dict[str, list[float]]] = {
            v: {"seconds": [], "bytes": []} for v in args.variants}
        loads: list[float] = []
        with tempfile.TemporaryDirectory() as tmp:
            for trial in range(args.trials):
                shift = trial % len(args.variants)
                order = args.variants[shift:] + args.variants[:shift]
                for variant in order:
                    loads.append(os.getloadavg()[0])
                    got = run_one(workload, variant, args.rounds, seed=trial,
                                  out=Path(tmp) / f"{workload}-{variant}-{trial}")
                    for key, value in got.items():
                        figures[variant][key].append(value)
                    print(f"  {workload} trial {trial} {variant:8s} {got['seconds'] * 1e3:9.1f} ms"
                          f" {got['bytes'] / 1e6:9.3f} MB/round (load {loads[-1]:.1f})",
                          flush=True)
        base = figures.get("plain")
        print(f"\n{workload}: {args.trials} trials x {args.rounds} rounds (first left out), "
              f"load average {min(loads):.1f}–{max(loads):.1f}")
        print("| variant | round, ms | bytes a round, MB | time vs plain | bytes vs plain |")
        print("|---|---|---|---|---|")
        for variant in args.variants:
            f = figures[variant]
            t_ratio = b_ratio = "–"
            if base is not None:
                t_ratio = (f"{statistics.median(f['seconds']) / statistics.median(base['seconds']):.2f}×")
                b_ratio = (f"{statistics.median(f['bytes']) / statistics.median(base['bytes']):.3f}×")
            print(f"| {variant} | {_spread(f['seconds'], 1e3, '{:.1f}')} | "
                  f"{_spread(f['bytes'], 1e-6, '{:.3f}')} | {t_ratio} | {b_ratio} |")
        print(flush=True)
    print(f"end {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
