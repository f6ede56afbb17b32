"""What the non-finite scan at the boundary costs a fold of a 10M-parameter model (issue 34).

Run (from the repository root, in the dev venv)::

    git worktree add --detach /tmp/base 9b8d33e      # the code before the scan
    python benchmarks/nonfinite_scan.py --baseline /tmp/base
    python benchmarks/nonfinite_scan.py --baseline /tmp/base --params 10000000 --trials 7

One trial folds ``--contributors`` contributions of a ``--params``-parameter
float32 model (four arrays) the way the flat round engine does at the
coordinator: each pulled contribution is checked against the round's model
(``check_contribution``: keys, shapes, dtypes), then added to the
``--aggregator``'s fold; then the fold's result. Two ways of this code are
timed against the baseline (the code before, imported from ``DIR``):

* ``engine`` -- as the round engine checks a contribution for this
  aggregator: for ``fedavg``/``allreduce`` (the engine's own strict mean,
  which finds NaN while it sums) no scan of the elements; for any other
  rule the scan;
* ``scanned`` -- always the scan (one sum per float array, the exact check
  only when the sum is not finite): what a robust rule pays;
* ``ranged`` -- the scan with the strict mean's range (one sum of squares
  per float array, :func:`out_of_range_leaf`): what a host relay's fold and
  a replayed round pay since the range check (issue 34); timed against the
  baseline's ``scanned``, which they paid before.

Each trial runs every side in fresh processes, alternating, so load hits
all alike. Printed: ms per contribution for each (best trial, and the
spread), the ratios (> 1: slower than the baseline), and the scan alone.

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


def _contributions(params: int, contributors: int) -> tuple[dict, list[dict]]:
    import numpy as np

    rng = np.random.default_rng(0)
    sizes = [params // 4] * 3 + [params - 3 * (params // 4)]
    model = {f"w{i}": np.zeros(n, np.float32) for i, n in enumerate(sizes)}
    states = [{k: rng.standard_normal(v.size, dtype=np.float32) for k, v in model.items()}
              for _ in range(contributors)]
    return model, states


def one_trial(params: int, contributors: int, repeats: int, aggregator_name: str,
              mode: str) -> float:
    """Milliseconds per contribution of a checked fold, the best of ``repeats``."""
    import inspect

    import meshkit.plugins
    from meshkit.aggregation import MeanFold, begin
    from meshkit.train._messages import check_contribution, signature

    model, states = _contributions(params, contributors)
    aggregator = meshkit.plugins.create("aggregator", aggregator_name)
    expected = signature(model)
    kw: dict = {}
    parameters = inspect.signature(check_contribution).parameters
    if "finite" in parameters:  # not in the first baseline
        fold = begin(aggregator, reference=model)
        strict_mean = type(fold) is MeanFold
        kw = {"finite": mode in ("scanned", "ranged") or not strict_mean}
        if mode == "ranged" and "limit" in parameters:  # not in the code before the range
            kw["limit"] = fold.value_limit
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fold = begin(aggregator, reference=model)
        for i, state in enumerate(states):
            check_contribution(state, expected, f"rank {i + 1}'s result", **kw)
            fold.add(state, 100.0 + i, source=f"client {i}")
        fold.result()
        best = min(best, time.perf_counter() - start)
    return best / contributors * 1e3


def scan_alone(params: int) -> float:
    """Milliseconds of the non-finite scan of one contribution (this tree only)."""
    from meshkit.train._messages import nonfinite_leaf

    _, states = _contributions(params, 1)
    best = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        for value in states[0].values():
            nonfinite_leaf(value)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _child(args: argparse.Namespace, tree: Path | None, mode: str) -> float:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree), str(tree / "plugins")])
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); "
            f"import nonfinite_scan as b; "
            f"print(b.one_trial({args.params}, {args.contributors}, {args.repeats}, "
            f"{args.aggregator!r}, {mode!r}))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, check=True, cwd="/" if tree is not None else str(ROOT))
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True,
                        help="a checkout of the code before the change (its repository root)")
    parser.add_argument("--params", type=int, default=10_000_000)
    parser.add_argument("--contributors", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--aggregator", default="fedavg")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    figures: dict[str, list[float]] = {"engine": [], "scanned": [], "ranged": [],
                                       "baseline": [], "baseline-scanned": []}
    for _ in range(args.trials):
        figures["engine"].append(_child(args, None, "engine"))
        figures["baseline"].append(_child(args, args.baseline, "engine"))
        figures["scanned"].append(_child(args, None, "scanned"))
        figures["ranged"].append(_child(args, None, "ranged"))
        figures["baseline-scanned"].append(_child(args, args.baseline, "scanned"))
    alone = scan_alone(args.params)
    ratios = {"engine": min(figures["engine"]) / min(figures["baseline"]),
              "scanned": min(figures["scanned"]) / min(figures["baseline"]),
              "ranged": min(figures["ranged"]) / min(figures["baseline-scanned"])}
    if args.json:
        print(json.dumps({"figures": figures, "scan_ms": alone, "ratios": ratios,
                          "params": args.params, "contributors": args.contributors,
                          "aggregator": args.aggregator}))
        return
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"# {args.aggregator} fold of {args.contributors} x {args.params:,} float32 params, "
          f"each checked first; ms per contribution, best of {args.trials} trials "
          f"(min..max); load {load}")
    for name, values in figures.items():
        print(f"{name:>16}: {min(values):8.2f}  ({min(values):.2f}..{max(values):.2f})")
    for name, ratio in ratios.items():
        base = "baseline-scanned" if name == "ranged" else "baseline"
        print(f"{name:>16} / {base}: {ratio:.3f}")
    print(f"     scan: {alone:.2f} ms per contribution, alone")


if __name__ == "__main__":
    main()
