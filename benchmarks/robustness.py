"""The robustness matrix: final accuracy of each aggregator under each attack (issue 25).

Run (from the repository root, in the dev venv; the heat map needs the
``plot`` extra, matplotlib)::

    python benchmarks/robustness.py                       # the matrix in docs/robustness.md
    python benchmarks/robustness.py --rounds 5 --rules fedavg median --attacks none sign-flip
    python benchmarks/robustness.py --seeds 0 1 2         # the spread over seeds
    python benchmarks/robustness.py --json                # one JSON line per cell

Setup (fixed): task ``digits`` (default options: a 64-32-10 MLP, one local
epoch of SGD at lr 0.1, batch 32), 20 clients split by the ``dirichlet``
partitioner (alpha 0.5, the run seed), every client in every round, 30
rounds, ``f = 4`` attackers: clients chosen once per run by ``[attack]
fraction = 0.2`` (a permutation seeded by the run seed). Rules that take
``f`` are told the true ``f = 4``. Accuracy is the coordinator's
evaluation of the final global model on the held-out 20 % of the digits.

Each cell is the real round engine and strategy: the ``federated``
strategy plays its rounds through :func:`meshkit.train.fold_round` against
in-process workers (:class:`meshkit.train.LocalPool`, which runs the real
worker, :class:`meshkit.train.Trainer`, and round-trips every request and
reply through the trainer protocol's encoding), with the attack applied
where the contribution arrives, as in a ``meshkit run`` with an
``[attack]`` table. No sockets or processes: the matrix measures the
rules, not the mesh. The baseline row is ``fedavg`` and the baseline
column ``none`` (no attack); the printed ratio is each cell over its
rule's no-attack accuracy.

This is a benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import meshkit
from meshkit.attack import choose_attackers
from meshkit.train import AttackPlan, LocalPool, StrategyContext, Trainer

ROOT = Path(__file__).resolve().parents[1]

CLIENTS = 20
ATTACKERS = 4
ALPHA = 0.5
ROUNDS = 30

#: The rules, with the options the matrix uses (f = the true number of attackers).
RULES: dict[str, dict[str, Any]] = {
    "fedavg": {},
    "median": {},
    "trimmed-mean": {"beta": 0.2},
    "krum": {"f": ATTACKERS},
    "multi-krum": {"f": ATTACKERS},
    "bulyan": {"f": ATTACKERS},
    "geometric-median": {},
    "centered-clipping": {"tau": 0.3, "iterations": 3},
    "norm-bound": {"max_norm": 0.3},
}

#: The attacks, with the options the matrix uses (docs/robustness.md says why).
ATTACKS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "sign-flip": {"factor": 10.0},
    "scale": {"factor": 10.0},
    "gaussian": {"sigma": 1.0},
    "label-flip": {},
    "ipm": {"epsilon": 100.0},
    "ipm-small": {"epsilon": 0.1},
    "alie": {},
    "same-value": {"value": 100.0},
}


def attack_name(column: str) -> str:
    return "ipm" if column.startswith("ipm") else column


def run_cell(rule: str, column: str, *, seed: int, rounds: int, workers: int = 2) -> dict:
    """One cell: a federated run of ``rounds`` rounds; its final metrics."""
    pset = meshkit.plugins.default()
    task = pset.create("task", "digits")
    partitioner = pset.create("partitioner", "dirichlet", {"alpha": ALPHA})
    trainers = {r: Trainer(pset.create("task", "digits"), partitioner=partitioner,
                           partitioner_name="dirichlet", seed=seed)
                for r in range(1, workers + 1)}
    pool = LocalPool(trainers)
    strategy = pset.create("strategy", "federated", {"rounds": rounds, "clients": CLIENTS})
    options = ATTACKS[column]
    attack = None
    if options is not None:
        name = attack_name(column)
        attack = AttackPlan(name=name, options=options, attack=pset.create("attack", name, options),
                            clients=choose_attackers(CLIENTS, fraction=ATTACKERS / CLIENTS,
                                                     seed=seed),
                            seed=seed)
    history: list[dict] = []
    ctx = StrategyContext(task=task, aggregator=pset.create("aggregator", rule, RULES[rule]),
                          pool=pool, workers=sorted(trainers), rng=np.random.default_rng(seed),
                          seed=seed, outer=pset.create("outer_optimizer", "average"),
                          strategy_name="federated", partitioner=partitioner, attack=attack,
                          on_round=lambda report, state: history.append(report.to_json()))
    started = time.perf_counter()
    try:
        result = strategy.run(ctx)
        accuracy = float(result.metrics["accuracy"])
        error = None
    except meshkit.MeshError as exc:  # a run that broke (non-finite model): a result too
        accuracy, error = float("nan"), str(exc).splitlines()[0][:200]
    return {"rule": rule, "attack": column, "seed": seed, "rounds": rounds,
            "accuracy": accuracy, "error": error,
            "attacked": history[-1]["attacked"] if history else [],
            "seconds": round(time.perf_counter() - started, 2)}


def heatmap(matrix: dict[tuple[str, str], float], rules: list[str], columns: list[str],
            path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = np.array([[matrix[r, c] for c in columns] for r in rules])
    fig, ax = plt.subplots(figsize=(0.9 * len(columns) + 2.5, 0.45 * len(rules) + 1.8))
    image = ax.imshow(np.nan_to_num(values, nan=0.0), cmap="RdYlGn", vmin=0.0, vmax=1.0,
                      aspect="auto")
    labels = {"ipm": "ipm (eps 100)", "ipm-small": "ipm (eps 0.1)",
              "sign-flip": "sign-flip (x10)"}
    ax.set_xticks(range(len(columns)), [labels.get(c, c) for c in columns],
                  rotation=35, ha="right")
    ax.set_yticks(range(len(rules)), rules)
    for i in range(len(rules)):
        for j in range(len(columns)):
            v = values[i, j]
            ax.text(j, i, "err" if np.isnan(v) else f"{v:.2f}", ha="center", va="center",
                    fontsize=8)
    ax.set_title(f"digits, {CLIENTS} clients (Dirichlet {ALPHA}), {ATTACKERS} attackers: "
                 f"final accuracy", fontsize=10)
    fig.colorbar(image, ax=ax, fraction=0.03)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rules", nargs="+", default=list(RULES), choices=list(RULES))
    parser.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=list(ATTACKS))
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--json", action="store_true", help="one JSON line per cell")
    parser.add_argument("--plot", type=Path, default=None,
                        help="write the heat map here (e.g. docs/robustness.png)")
    args = parser.parse_args(argv)
    cells: dict[tuple[str, str], list[float]] = {}
    started = time.perf_counter()
    for rule in args.rules:
        for column in args.attacks:
            for seed in args.seeds:
                cell = run_cell(rule, column, seed=seed, rounds=args.rounds)
                cells.setdefault((rule, column), []).append(cell["accuracy"])
                if args.json:
                    print(json.dumps(cell), flush=True)
                else:
                    print(f"  {rule:>18} {column:>10} seed {seed}: {cell['accuracy']:.3f}"
                          + (f"  ({cell['error']})" if cell["error"] else ""),
                          file=sys.stderr, flush=True)
    matrix = {k: statistics.fmean(v) for k, v in cells.items()}
    spread = {k: (min(v), max(v)) for k, v in cells.items()}
    if not args.json:
        print(f"digits, {CLIENTS} clients, Dirichlet alpha {ALPHA}, {ATTACKERS} attackers, "
              f"{args.rounds} rounds, seeds {args.seeds}: final accuracy "
              f"(mean over seeds; min-max when more than one)")
        print("| rule | " + " | ".join(args.attacks) + " |")
        print("|---" * (len(args.attacks) + 1) + "|")
        for rule in args.rules:
            row = []
            for column in args.attacks:
                v = matrix[rule, column]
                lo, hi = spread[rule, column]
                text = "err" if np.isnan(v) else f"{v:.3f}"
                if len(args.seeds) > 1 and not np.isnan(v):
                    text += f" ({lo:.2f}-{hi:.2f})"
                row.append(text)
            print(f"| `{rule}` | " + " | ".join(row) + " |")
        if "none" in args.attacks:
            print("\nratio to the rule's no-attack accuracy (baseline column `none`):")
            for rule in args.rules:
                base = matrix[rule, "none"]
                print(f"  {rule:>18}: " + "  ".join(
                    f"{c} {matrix[rule, c] / base:.2f}" for c in args.attacks if c != "none"))
        print(f"\n{len(cells) * len(args.seeds)} runs in {time.perf_counter() - started:.0f} s")
    if args.plot is not None:
        heatmap(matrix, args.rules, args.attacks, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
