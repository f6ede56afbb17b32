"""The robustness matrix: final accuracy of each aggregator under each attack (issue 25).

Run (from the repository root, in the dev venv; the heat map needs the
``plot`` extra, matplotlib)::

    python benchmarks/robustness.py                       # the matrix in docs/robustness.md
    python benchmarks/robustness.py --rounds 5 --rules fedavg median --attacks none sign-flip
    python benchmarks/robustness.py --seeds 0 1 2         # the spread over seeds
    python benchmarks/robustness.py --json                # one JSON line per cell
    python benchmarks/robustness.py --config my-run.toml  # your task, split and rounds

With ``--config`` the matrix is made for your own model: the config's task
(``[run] task``, ``[task]`` options), its ``[partitioner]``, ``[strategy]
clients``, ``rounds`` and ``[run] seed`` replace the fixed setup below; the
attackers are the config's ``[attack]`` count when it has one, else 20 % of
the clients, and the rules that take ``f`` are told that count. ``--plot``
checks that matplotlib is importable before any run starts (``pip install
'meshkit[plot]'``), so a missing library costs nothing.

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
from meshkit.train import (AttackPlan, LocalPool, StrategyContext, Trainer, build_components,
                           check)

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


class Setup:
    """What a cell trains: the fixed ``digits`` setup, or a config's (``--config``)."""

    def __init__(self, config: str | None = None) -> None:
        self.config = config
        if config is None:
            pset = meshkit.plugins.default()
            self.label = "digits"
            self.make_task = lambda: pset.create("task", "digits")
            self.partitioner = pset.create("partitioner", "dirichlet", {"alpha": ALPHA})
            self.partitioner_name = "dirichlet"
            self.strategy_name, self.strategy_options = "federated", {"clients": CLIENTS}
            self.clients, self.attackers, self.rounds, self.seed = CLIENTS, ATTACKERS, ROUNDS, 0
            self.description = f"Dirichlet alpha {ALPHA}"
            return
        plan = check(config)  # every start-up check of `meshkit run` (ConfigError: exit 2)
        parts = build_components(plan)
        cfg = plan.config
        self.label = f"{cfg.run.task} ({config})"
        self.make_task = lambda: plan.create("task")
        self.partitioner, self.partitioner_name = parts["partitioner"], cfg.partitioner_name
        self.strategy_name = cfg.strategy.name
        shares = parts["clients"]
        self.clients = shares.count if shares is not None else cfg.mesh.workers
        self.strategy_options = {**{k: v for k, v in cfg.strategy.options.items()
                                    if k not in ("name", "rounds")}, "clients": self.clients}
        attack = parts["attack"]
        self.attackers = (len(attack.clients) if attack is not None
                          else max(1, round(0.2 * self.clients)))
        self.rounds = int(parts["rounds"] or ROUNDS)
        self.seed = int(cfg.run.seed)
        self.description = f"[partitioner] {cfg.partitioner_name}"

    def rule_options(self, rule: str) -> dict[str, Any]:
        """The matrix's options for ``rule``, ``f`` being this setup's attacker count."""
        options = dict(RULES[rule])
        if "f" in options:
            options["f"] = self.attackers
        return options

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


def run_cell(rule: str, column: str, *, seed: int, rounds: int, workers: int = 2,
             setup: Setup | None = None) -> dict:
    """One cell: a federated run of ``rounds`` rounds; its final metrics."""
    setup = setup or Setup()
    pset = meshkit.plugins.default()
    task = setup.make_task()
    trainers = {r: Trainer(setup.make_task(), partitioner=setup.partitioner,
                           partitioner_name=setup.partitioner_name, seed=seed)
                for r in range(1, workers + 1)}
    pool = LocalPool(trainers)
    strategy = pset.create("strategy", setup.strategy_name,
                           {**setup.strategy_options, "rounds": rounds})
    options = ATTACKS[column]
    attack = None
    if options is not None:
        name = attack_name(column)
        attack = AttackPlan(name=name, options=options, attack=pset.create("attack", name, options),
                            clients=choose_attackers(setup.clients,
                                                     fraction=setup.attackers / setup.clients,
                                                     seed=seed),
                            seed=seed)
    history: list[dict] = []
    ctx = StrategyContext(task=task, aggregator=pset.create("aggregator", rule,
                                                            setup.rule_options(rule)),
                          pool=pool, workers=sorted(trainers), rng=np.random.default_rng(seed),
                          seed=seed, outer=pset.create("outer_optimizer", "average"),
                          strategy_name=setup.strategy_name, partitioner=setup.partitioner,
                          attack=attack,
                          on_round=lambda report, state: history.append(report.to_json()))
    started = time.perf_counter()
    try:
        result = strategy.run(ctx)
        accuracy = float(result.metrics["accuracy"])
        error = None
    except meshkit.MeshError as exc:  # a run that broke (non-finite model): a result too
        accuracy, error = float("nan"), str(exc).splitlines()[0][:200]
    return {"rule": rule, "attack": column, "seed": seed, "rounds": rounds,
            "task": setup.label, "accuracy": accuracy, "error": error,
            "attacked": history[-1]["attacked"] if history else [],
            "seconds": round(time.perf_counter() - started, 2)}


def heatmap(matrix: dict[tuple[str, str], float], rules: list[str], columns: list[str],
            path: Path, title: str) -> None:
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
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, fraction=0.03)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rules", nargs="+", default=list(RULES), choices=list(RULES))
    parser.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=list(ATTACKS))
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"rounds per run (default {ROUNDS}, or the config's)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="run seeds (default 0, or the config's [run] seed)")
    parser.add_argument("--config", default=None,
                        help="a meshkit config: its task, partitioner, clients, rounds and "
                             "seed instead of the fixed digits setup")
    parser.add_argument("--json", action="store_true", help="one JSON line per cell")
    parser.add_argument("--plot", type=Path, default=None,
                        help="write the heat map here (e.g. docs/robustness.png)")
    args = parser.parse_args(argv)
    if args.plot is not None:
        try:  # before the runs, not after an hour of them
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib, which is not installed: pip install "
                         "'meshkit[plot]' (or matplotlib), or leave out --plot")
    try:
        setup = Setup(args.config)
    except meshkit.MeshError as exc:
        parser.error(str(exc))
    rounds = args.rounds if args.rounds is not None else setup.rounds
    seeds = args.seeds if args.seeds is not None else [setup.seed]
    cells: dict[tuple[str, str], list[float]] = {}
    started = time.perf_counter()
    for rule in args.rules:
        for column in args.attacks:
            for seed in seeds:
                cell = run_cell(rule, column, seed=seed, rounds=rounds, setup=setup)
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
        print(f"{setup.label}, {setup.clients} clients, {setup.description}, "
              f"{setup.attackers} attackers, {rounds} rounds, seeds {seeds}: final accuracy "
              f"(mean over seeds; min-max when more than one)")
        print("| rule | " + " | ".join(args.attacks) + " |")
        print("|---" * (len(args.attacks) + 1) + "|")
        for rule in args.rules:
            row = []
            for column in args.attacks:
                v = matrix[rule, column]
                lo, hi = spread[rule, column]
                text = "err" if np.isnan(v) else f"{v:.3f}"
                if len(seeds) > 1 and not np.isnan(v):
                    text += f" ({lo:.2f}-{hi:.2f})"
                row.append(text)
            print(f"| `{rule}` | " + " | ".join(row) + " |")
        if "none" in args.attacks:
            print("\nratio to the rule's no-attack accuracy (baseline column `none`):")
            for rule in args.rules:
                base = matrix[rule, "none"]
                print(f"  {rule:>18}: " + "  ".join(
                    f"{c} {matrix[rule, c] / base:.2f}" for c in args.attacks if c != "none"))
        print(f"\n{len(cells) * len(seeds)} runs in {time.perf_counter() - started:.0f} s")
    if args.plot is not None:
        heatmap(matrix, args.rules, args.attacks, args.plot,
                f"{setup.label}, {setup.clients} clients ({setup.description}), "
                f"{setup.attackers} attackers: final accuracy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
