"""How much more noise distributed DP adds than central DP at the same ε, and where it comes from (issue 41).

``python benchmarks/ddp_noise_budget.py [--clients 500] [--q 0.05] [--rounds 200]``

For the paired benchmark's configuration (benchmarks/distributed_dp.py:
``digits``' model, 2,410 coordinates (64·32 + 32 + 32·10 + 10; the benchmark's
``LENGTH`` said 650 until issue 41's third pass, which moved its ε by 1e-6), S = 1, δ = 1e-5, ``modulus_bits`` = 16 +
⌈log₂ clients⌉, the grid planned for every client of the run, an expected
cohort of q·clients) this prints, as JSON:

* the distributed plan at each matched z: the grid S·s, the Skellam
  variance on the sum μ (grid steps²), the noise std on the sum in units of
  the update (√μ/s, what the model meets; central's is z·S), the l2
  sensitivity the accountant uses Δ₂ (conditional rounding's inflated
  bound) and Δ₁, and the accounted multiplier √μ/Δ₂;
* the z each accounting needs for central's PLD ε and RDP ε, removing one
  of the distributed mechanism's terms at a time: the Gaussian by RDP over
  dp-accounting's orders (fractional ones too), the Gaussian by RDP over the
  Skellam accountant's integer orders only, the Skellam accountant with
  Δ₂ = S·s (no rounding inflation) and with no Δ₁ term, and the Skellam
  accountant as the run uses it. The ratio of two neighbouring columns is
  the noise that term costs.

No training: accountant arithmetic only, a few seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Callable

import numpy as np

from meshkit.privacy import epsilon_pld, epsilon_rdp, field_levels, plan_skellam
from meshkit.privacy._skellam_accountant import SKELLAM_ORDERS, epsilon_skellam
from meshkit.task import create_task

DELTA = 1e-5
#: digits' coordinates, from the task itself
LENGTH = sum(int(np.asarray(v).size) for v in create_task("digits").init_state(0).values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=500)
    parser.add_argument("--q", type=float, default=0.05)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    q, rounds = args.q, args.rounds
    bits = 16 + (args.clients - 1).bit_length()
    cohort = round(q * args.clients)

    def plan(z: float):  # type: ignore[no-untyped-def]
        return plan_skellam(clip_norm=1.0, noise_multiplier=z, cohort=cohort, length=LENGTH,
                            levels=field_levels(bits, cohort), bits=bits,
                            population=args.clients)

    def skellam(z: float, inflation: bool = True, l1_term: bool = True) -> float:
        p = plan(z)
        grid = p.scale  # S = 1: grid steps per clip norm
        l2 = p.bound if inflation else grid
        l1 = (p.l1 if inflation else min(grid * grid, math.sqrt(LENGTH) * grid)) \
            if l1_term else 1e-12
        return epsilon_skellam([(q, p.sum_variance(cohort), l2, l1, rounds)], DELTA)

    integers = [float(a) for a in SKELLAM_ORDERS]
    ways: dict[str, Callable[[float], float]] = {
        "gaussian_rdp_all_orders": lambda z: epsilon_rdp([(q, z, rounds)], DELTA),
        "gaussian_rdp_integer_orders": lambda z: epsilon_rdp([(q, z, rounds)], DELTA,
                                                             orders=integers),
        "skellam_no_inflation_no_l1": lambda z: skellam(z, inflation=False, l1_term=False),
        "skellam_no_inflation": lambda z: skellam(z, inflation=False),
        "skellam_as_run": skellam,
    }

    def solve(f: Callable[[float], float], target: float) -> float:
        low, high = 0.5, 2.0
        for _ in range(60):
            mid = (low + high) / 2
            low, high = (mid, high) if f(mid) > target else (low, mid)
        return high

    targets = {"pld": epsilon_pld([(q, 1.0, rounds)], DELTA),
               "rdp": epsilon_rdp([(q, 1.0, rounds)], DELTA)}
    out: dict[str, object] = {"clients": args.clients, "q": q, "rounds": rounds,
                              "coordinates": LENGTH,
                              "modulus_bits": bits, "central_z": 1.0,
                              "central_epsilon": targets}
    for name, target in targets.items():
        need = {way: solve(f, target) for way, f in ways.items()}
        p = plan(need["skellam_as_run"])
        mu = p.sum_variance(cohort)
        out[f"at_{name}_epsilon"] = {
            "z_needed": need,
            "distributed_plan": {
                "grid_steps_per_clip_norm": p.scale, "half": p.half,
                "client_variance": p.variance, "sum_variance_mu": mu,
                "noise_std_on_sum_over_S": math.sqrt(mu) / p.scale,
                "l2_bound": p.bound, "l2_inflation": p.bound / p.scale, "l1_bound": p.l1,
                "accounted_multiplier": math.sqrt(mu) / p.bound,
                # conditional rounding's own variance on the sum, at most n/4 grid steps²
                "rounding_variance_over_mu": cohort / 4 / mu,
                "epsilon": skellam(need["skellam_as_run"])},
            "noise_ratio_distributed_over_central": need["skellam_as_run"]}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
