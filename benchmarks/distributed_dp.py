"""Distributed DP (Skellam, clients add the noise under SecAgg+) against central DP at the same ε.

``python benchmarks/distributed_dp.py [--clients 500] [--q 0.05] [--rounds 200] [--seeds 3]
[--first-seed 0] [--accountants pld,rdp]``

Every run trains ``digits`` with user-level DP-FedAvg: clip S = 1, Poisson
sampling with probability q, ``fedavgm`` (lr 1, momentum 0.9), client lr 0.5.
Central: ``dp-fixed`` with z = ``--z``, trained once a seed and accounted by
each ``--accountants`` entry (``"pld"``, the run's own accountant, and
``"rdp"``, :func:`meshkit.privacy.epsilon_rdp` of the same rounds: the figure a
run with ``accountant = "rdp"`` reports; the accountant does not change the
training). Distributed: the same with ``placement = "distributed"`` under
``[secure_aggregation]`` (``modulus_bits`` = 16 + ⌈log₂ clients⌉, what
``meshkit check`` plans for a cohort of every client), once per accountant
too, its z found by bisection so that the Skellam accountant's ε after
``--rounds`` (with the grid of the expected cohort) equals that central
accountant's. Prints one JSON line per run and a summary.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import meshkit
from meshkit.privacy import epsilon_pld, epsilon_rdp
from meshkit.train import read_metrics
from meshkit_privacy.distributed import DistributedSkellam

LENGTH = 650  # digits' model: 64 x 10 weights and 10 biases


def _skellam_epsilon(z: float, q: float, rounds: int, cohort: int, bits: int,
                     delta: float) -> float:
    mech = DistributedSkellam(clip_norm=1.0, noise_multiplier=z, delta=delta)
    mech.plan_round(cohort=cohort, length=LENGTH, bits=bits)
    return mech.epsilon_after(q, rounds)


def matching_z(target: float, q: float, rounds: int, cohort: int, bits: int,
               delta: float) -> float:
    low, high = 0.3, 10.0
    for _ in range(40):
        mid = math.sqrt(low * high)
        if _skellam_epsilon(mid, q, rounds, cohort, bits, delta) > target:
            low = mid
        else:
            high = mid
    return high


def config(out: Path, seed: int, clients: int, q: float, rounds: int, z: float,
           distributed: bool, bits: int) -> dict[str, Any]:
    table: dict[str, Any] = {
        "run": {"task": "digits", "seed": seed, "out": str(out)},
        "mesh": {"launch": "local", "workers": 2},
        "strategy": {"name": "federated", "rounds": rounds, "clients": clients,
                     "fraction": q, "sampling": "poisson"},
        "privacy": {"name": "dp-fixed", "clip": "client", "clip_norm": 1.0,
                    "noise_multiplier": z, "delta": 1e-5},
        "outer_optimizer": {"name": "fedavgm", "lr": 1.0, "momentum": 0.9},
        "task": {"lr": 0.5}}
    if distributed:
        table["privacy"]["placement"] = "distributed"
        table["secure_aggregation"] = {"name": "secagg+", "modulus_bits": bits}
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=500)
    parser.add_argument("--q", type=float, default=0.05)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0,
                        help="seeds first-seed .. first-seed + seeds - 1")
    parser.add_argument("--z", type=float, default=1.0)
    parser.add_argument("--accountants", default="pld,rdp",
                        help="central accountants to compare with, comma-separated")
    parser.add_argument("--distributed-z", type=float, default=0.0,
                        help="run distributed DP at this z instead of the matching ones (its "
                             "ε is then the Skellam accountant's, printed)")
    parser.add_argument("--only", choices=("central", "distributed"), default=None)
    args = parser.parse_args()
    delta = 1e-5
    bits = 16 + (args.clients - 1).bit_length()
    cohort = round(args.q * args.clients)
    accountants = [a for a in args.accountants.split(",") if a]
    epsilon_of = {"pld": epsilon_pld, "rdp": epsilon_rdp}
    runs: list[tuple[str, float, bool]] = [("central", args.z, False)]
    for name in accountants:
        target = epsilon_of[name]([(args.q, args.z, args.rounds)], delta)
        z_d = args.distributed_z or matching_z(target, args.q, args.rounds, cohort, bits,
                                               delta)
        print(json.dumps({"accountant": name, "central_z": args.z, "central_epsilon": target,
                          "distributed_z": z_d,
                          "distributed_epsilon": _skellam_epsilon(z_d, args.q, args.rounds,
                                                                  cohort, bits, delta),
                          "modulus_bits": bits}), flush=True)
        runs.append((f"distributed-at-{name}", z_d, True))
    results: dict[str, list[float]] = {kind: [] for kind, *_ in runs}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for kind, z, distributed in runs:
                if args.only and not kind.startswith(args.only):
                    continue
                out = Path(tmp) / f"{kind}-{seed}"
                started = time.time()
                result = meshkit.run(config(out, seed, args.clients, args.q, args.rounds, z,
                                            distributed, bits))
                rows = read_metrics(out)
                accuracy = rows[-1]["accuracy"]
                results[kind].append(accuracy)
                line = {"kind": kind, "seed": seed, "z": z, "ok": result.ok,
                        "rounds": len(rows), "accuracy": accuracy,
                        "epsilon": rows[-1]["epsilon"],
                        "seconds": round(time.time() - started, 1)}
                if not distributed:  # the same rounds, by each central accountant
                    line["epsilon_by"] = {name: epsilon_of[name]([(args.q, z, len(rows))],
                                                                 delta)
                                          for name in accountants}
                print(json.dumps(line), flush=True)
    summary: dict[str, Any] = {k: {"mean": statistics.mean(v), "values": v,
                                   "sd": statistics.stdev(v) if len(v) > 1 else 0.0}
                               for k, v in results.items() if v}
    for name in accountants:
        central, dist = "central", f"distributed-at-{name}"
        if central in summary and dist in summary:
            gaps = [100 * (c - d) for c, d in zip(results[central], results[dist])]
            summary[f"gap_points_{name}"] = {
                "mean": statistics.mean(gaps), "per_seed": gaps,
                "sd": statistics.stdev(gaps) if len(gaps) > 1 else 0.0}
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
