"""Differential privacy: the accountant against dp-accounting, accuracy against ε, DP's cost.

Run (from the repository root, in the dev venv)::

    python benchmarks/privacy.py --accountant                  # ε vs dp-accounting's
    python benchmarks/privacy.py --accountant --reference-python /tmp/dpvenv/bin/python
    python benchmarks/privacy.py                               # accuracy vs ε on digits
    python benchmarks/privacy.py --rounds 20 --z 1             # a quick look
    python benchmarks/privacy.py --fold                        # the fold's own cost

``--accountant`` computes ε for the grid of ``benchmarks/privacy_reference.py``
(q from 0.001 to 0.1, z from 0.5 to 2, T up to 2,000) with meshkit's PLD and
RDP accountants and compares them with Google's ``dp-accounting`` 0.6: its
values are recomputed when the library is importable here or
``--reference-python`` names a Python that has it (dp-accounting pins
``attrs<24``, which meshkit's cattrs cannot take, so it lives in its own
venv), and read from ``tests/privacy/data/dp_accounting_reference.json``
otherwise. Printed: each point's ε both ways, the relative difference, and
the time of each side (the baseline: dp-accounting's, when recomputed).

The default mode trains ``digits`` federated with many clients (1,000 by
default, Poisson sampling q = 0.05, so m = 50 clients a round) under
``dp-fixed`` at each noise multiplier of ``--z``, and the same run without
``[privacy]`` (the baseline), with real workers (``meshkit.run``, local
launch). Printed per run: ε at δ = 1e-5 after the rounds, the final held-out
accuracy (mean and spread over ``--repeat`` seeds) and seconds per round,
with DP's cost as the ratio of its seconds per round to the baseline's.
``--plot FILE`` draws accuracy against ε (matplotlib). ``--fold`` times what
DP adds on the coordinator, in-process so the machine's load moves it less:
folding a cohort of updates with fedavg's ``MeanFold`` (the baseline) against
the noised sum (a subtraction, a norm and a clip per update, then one
Gaussian draw per coordinate). The noise is
``seeded`` so the figures repeat; that is for measuring, not protecting.
This is a benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "tests" / "privacy" / "data" / "dp_accounting_reference.json"
sys.path.insert(0, str(ROOT / "benchmarks"))


def _reference(python: str | None) -> tuple[list[dict[str, Any]], str, float | None]:
    """dp-accounting's values: (rows, where they came from, seconds it took or None)."""
    from privacy_reference import GRID, reference

    try:
        import dp_accounting  # noqa: F401 (only whether it imports)
    except ImportError:
        pass
    else:
        start = time.perf_counter()
        rows = reference(GRID)
        return rows, "dp-accounting, recomputed here", time.perf_counter() - start
    if python:
        start = time.perf_counter()
        done = subprocess.run([python, str(ROOT / "benchmarks" / "privacy_reference.py")],
                              capture_output=True, text=True, check=True)
        seconds = time.perf_counter() - start
        data = json.loads(done.stdout)
        return data["rows"], f"{data['library']}, recomputed with {python}", seconds
    data = json.loads(REFERENCE.read_text())
    return data["rows"], f"{data['library']}, stored in {REFERENCE.relative_to(ROOT)}", None


def accountant(python: str | None) -> None:
    from meshkit.privacy import epsilon_pld, epsilon_rdp

    rows, source, theirs = _reference(python)
    print(f"reference: {source}")
    print(f"{'q':>6} {'z':>4} {'T':>5} {'delta':>6} | {'PLD':>8} {'ref':>8} {'diff':>8} | "
          f"{'RDP':>8} {'ref':>8} {'diff':>8}")
    worst = {"pld": 0.0, "rdp": 0.0}
    mine = {"pld": 0.0, "rdp": 0.0}
    for row in rows:
        group = [(row["q"], row["z"], row["rounds"])]
        got = {}
        for method, fn in (("pld", epsilon_pld), ("rdp", epsilon_rdp)):
            start = time.perf_counter()
            got[method] = fn(group, row["delta"])
            mine[method] += time.perf_counter() - start
            worst[method] = max(worst[method], abs(got[method] / row[method] - 1))
        print(f"{row['q']:>6g} {row['z']:>4g} {row['rounds']:>5} {row['delta']:>6g} | "
              f"{got['pld']:8.4f} {row['pld']:8.4f} {got['pld'] / row['pld'] - 1:+8.3%} | "
              f"{got['rdp']:8.4f} {row['rdp']:8.4f} {got['rdp'] / row['rdp'] - 1:+8.3%}")
    print(f"worst relative difference: PLD {worst['pld']:.3%}, RDP {worst['rdp']:.3%} "
          f"(the tests allow 1 %)")
    total = mine["pld"] + mine["rdp"]
    line = f"meshkit: {mine['pld']:.2f}s PLD + {mine['rdp']:.2f}s RDP for {len(rows)} points"
    if theirs is not None:
        line += f"; dp-accounting: {theirs:.2f}s (ratio meshkit/dp-accounting {total / theirs:.2f})"
    print(line)


def _config(out: Path, *, seed: int, rounds: int, clients: int, q: float, z: float | None,
            clip: float, workers: int, lr: float, server_lr: float) -> dict[str, Any]:
    config: dict[str, Any] = {
        "run": {"task": "digits", "seed": seed, "out": str(out)},
        "mesh": {"workers": workers, "timeout": 60.0},
        "task": {"lr": lr},
        "strategy": {"rounds": rounds, "clients": clients, "fraction": q,
                     "sampling": "poisson"},
        "outer_optimizer": {"name": "fedavgm", "lr": server_lr, "momentum": 0.9},
    }
    if z is not None:
        config["privacy"] = {"name": "dp-fixed", "clip_norm": clip, "noise_multiplier": z,
                             "noise": "seeded"}
    return config


def accuracy(args: argparse.Namespace) -> None:
    import meshkit
    from meshkit.train import read_metrics

    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for z in [None, *args.z]:
            accs, secs, eps = [], [], 0.0
            for rep in range(args.repeat):
                out = Path(tmp) / f"z{z}-{rep}"
                report = meshkit.run(_config(out, seed=rep, rounds=args.rounds,
                                             clients=args.clients, q=args.q, z=z,
                                             clip=args.clip, workers=args.workers,
                                             lr=args.lr, server_lr=args.server_lr))
                rows = read_metrics(out)
                accs.append(rows[-1]["accuracy"])
                # the first round includes warm-up (imports, first model sent)
                secs.append(statistics.median(r["seconds"] for r in rows[1:] or rows))
                eps = float(report.metrics.get("epsilon", float("inf")))
            label = "no DP" if z is None else f"z = {z:g}"
            results.append({"z": z, "epsilon": None if z is None else eps,
                            "accuracy": statistics.mean(accs),
                            "spread": max(accs) - min(accs), "seconds": statistics.mean(secs)})
            r = results[-1]
            print(f"{label:>9}  epsilon {'-' if z is None else f'{eps:.3g}':>7}  accuracy "
                  f"{r['accuracy']:.3f} (spread {r['spread']:.3f} over {args.repeat})  "
                  f"{r['seconds'] * 1000:.0f} ms/round", flush=True)
    base = results[0]["seconds"]
    for r in results[1:]:
        print(f"z = {r['z']:g}: DP costs {r['seconds'] / base:.2f}x the baseline's seconds "
              f"per round")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.2))
        private = [r for r in results if r["z"] is not None]
        ax.errorbar([r["epsilon"] for r in private], [r["accuracy"] for r in private],
                    yerr=[r["spread"] / 2 for r in private], marker="o", label="dp-fixed")
        for r in private:
            ax.annotate(f"z={r['z']:g}", (r["epsilon"], r["accuracy"]),
                        textcoords="offset points", xytext=(4, -10), fontsize=8)
        ax.axhline(results[0]["accuracy"], color="grey", ls="--", label="no DP")
        ax.set_xscale("log")
        ax.set_xlabel(f"ε at δ = 1e-5 after {args.rounds} rounds")
        ax.set_ylabel("held-out accuracy")
        ax.set_title(f"digits, {args.clients} clients, q = {args.q:g}, S = {args.clip:g}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")


def fold_cost(args: argparse.Namespace) -> None:
    """The coordinator's work per round: fedavg's fold against the noised sum, in-process."""
    import numpy as np

    from meshkit.aggregation import MeanFold
    from meshkit_privacy import NoisedSum

    rng = np.random.default_rng(0)
    for params in args.params:
        shapes = {"w": (int(params) - 10,), "b": (10,)}
        reference = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
        clients = [{k: (v + rng.normal(scale=0.01, size=v.shape)).astype(np.float32)
                    for k, v in reference.items()} for _ in range(args.cohort)]

        def plain() -> None:
            fold = MeanFold(weighted=True)
            for state in clients:
                fold.add(state, 1.0)
            fold.result()

        def private() -> None:
            fold = NoisedSum(reference, clip_norm=1.0, noise_std=1.0, expected=args.cohort,
                             rng=np.random.default_rng(1))
            for state in clients:
                fold.add(state)
            fold.result()

        times: dict[str, list[float]] = {"fedavg": [], "dp": []}
        for _ in range(args.repeat_fold):
            for name, fn in (("fedavg", plain), ("dp", private)):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        base, dp = (statistics.median(times[k]) for k in ("fedavg", "dp"))
        spread = {k: max(v) - min(v) for k, v in times.items()}
        print(f"{int(params):>9,} params x {args.cohort} clients: fedavg fold "
              f"{base * 1000:8.2f} ms (spread {spread['fedavg'] * 1000:.2f}), noised sum "
              f"{dp * 1000:8.2f} ms (spread {spread['dp'] * 1000:.2f}): {dp / base:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--accountant", action="store_true",
                        help="compare the accountant with dp-accounting")
    parser.add_argument("--reference-python", default=None,
                        help="a Python with dp-accounting installed, to recompute its values")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--q", type=float, default=0.05)
    parser.add_argument("--z", type=float, nargs="+", default=[0.3, 0.5, 0.7, 1.0, 2.0])
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=0.5, help="the clients' SGD rate")
    parser.add_argument("--server-lr", type=float, default=1.0, help="fedavgm's rate")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--plot", default=None, help="write accuracy against epsilon here")
    parser.add_argument("--fold", action="store_true",
                        help="time the coordinator's fold: fedavg against the noised sum")
    parser.add_argument("--params", type=float, nargs="+", default=[2410, 1e5, 1e6])
    parser.add_argument("--cohort", type=int, default=50)
    parser.add_argument("--repeat-fold", type=int, default=7)
    args = parser.parse_args()
    if args.accountant:
        accountant(args.reference_python)
    elif args.fold:
        fold_cost(args)
    else:
        accuracy(args)


if __name__ == "__main__":
    main()
