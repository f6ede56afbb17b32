"""What checking every message at the boundary costs the round engine (issue 21).

Run (from the repository root, in the dev venv)::

    python benchmarks/boundary.py --baseline DIR   # DIR: a checkout of the code before
    python benchmarks/boundary.py --baseline DIR --clients 400 --trials 7

A federated round of ``--clients`` clients on a tiny ``synthetic`` model
(``--params``, default 64: the fit costs next to nothing, so what is timed
is the engine and the pool -- set_state, fit with keep, take, and the fold
-- per client) over 4 in-process workers (``LocalPool``, whose replies now
pass the same ``check_reply`` as a real pool's, and each pulled result
``check_contribution``). Each trial runs this code and the baseline (the
same benchmark imported from ``DIR``, e.g. ``git archive main | tar -x -C
DIR``) in fresh processes, alternating, so load hits both alike. Printed:
microseconds per client for each, the best trial and the spread, and the
ratio (> 1: the checked engine is slower). Also printed: the cost of one
``check_reply`` for a fit reply and for a take reply of the model, timed
alone.

This is a measurement, not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_trial(clients: int, params: int, rounds: int) -> float:
    """Microseconds per client of ``rounds`` federated rounds, the best round."""
    import numpy as np

    import meshkit.plugins
    from meshkit.train import LocalPool, StrategyContext, Work, client_seed, fold_round

    def task():
        return meshkit.plugins.create("task", "synthetic",
                                      {"params": params, "arrays": 4, "rows": clients})

    ranks = [1, 2, 3, 4]
    ctx = StrategyContext(task=task(), aggregator=meshkit.plugins.create("aggregator", "fedavg"),
                          pool=LocalPool.of(task, ranks), workers=ranks,
                          rng=np.random.default_rng(0), timeout=30.0)
    state = ctx.task.init_state(0)
    best = float("inf")
    for rnd in range(1, rounds + 1):
        work = [Work(c, {"op": "fit", "shard": c, "shards": clients,
                         "seed": client_seed(0, rnd, c)}) for c in range(clients)]
        start = time.perf_counter()
        fold_round(ctx, work, state=state)
        best = min(best, time.perf_counter() - start)
    return best / clients * 1e6


def check_costs(params: int) -> dict[str, float]:
    """Microseconds per ``check_reply`` of a small fit reply and of a take reply."""
    import numpy as np

    from meshkit.train._messages import check_contribution, check_reply, signature

    model = {f"w{i}": np.zeros(params // 4, np.float32) for i in range(4)}
    cases = {
        "fit reply": ({"op": "fit", "keep": 3},
                      {"seq": 9, "examples": 12, "metrics": {"train_loss": 0.5}, "kept": 3}),
        "take reply": ({"op": "take"}, {"seq": 9, "state": model}),
    }
    out = {}
    for name, (request, reply) in cases.items():
        n = 20000
        start = time.perf_counter()
        for _ in range(n):
            check_reply(request, reply, 9)
        out[name] = (time.perf_counter() - start) / n * 1e6
    expected = signature(model)
    start = time.perf_counter()
    for _ in range(20000):
        check_contribution(model, expected, "x")
    out["model check"] = (time.perf_counter() - start) / 20000 * 1e6
    return out


def _child(args: argparse.Namespace, tree: Path | None) -> float:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree), str(tree / "plugins")])
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import boundary; "
            f"print(boundary.one_trial({args.clients}, {args.params}, {args.rounds}))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, check=True, cwd="/" if tree is not None else str(ROOT))
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True,
                        help="a checkout of the code before the change (its repository root)")
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--params", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    figures: dict[str, list[float]] = {"checked": [], "baseline": []}
    for _ in range(args.trials):
        figures["checked"].append(_child(args, None))
        figures["baseline"].append(_child(args, args.baseline))
    costs = check_costs(args.params)
    if args.json:
        print(json.dumps({"figures": figures, "check_us": costs, "clients": args.clients,
                          "params": args.params}))
        return
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"# round engine, {args.clients} clients, {args.params} params, 4 in-process "
          f"workers; us per client, best of {args.trials} trials (min..max); load {load}")
    for name, values in figures.items():
        print(f"{name:>9}: {min(values):8.1f}  ({min(values):.1f}..{max(values):.1f})")
    print(f"    ratio: {min(figures['checked']) / min(figures['baseline']):.3f} "
          f"(checked / baseline; > 1: the checks cost time)")
    for name, us in costs.items():
        print(f"{name:>11}: {us:.2f} us per check")


if __name__ == "__main__":
    main()
