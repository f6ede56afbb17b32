"""Is a paired central/distributed run's noise still coupled late in the run? (issue 41)

``python benchmarks/ddp_coupling_probe.py [--seed 300] [--rounds 100,200] [--lr 1e-6]``

The paired benchmark (benchmarks/distributed_dp.py ``--paired``) shows a
pair's accuracy agreeing over rounds 1–100 and drifting apart after. Two
explanations: the common random numbers stop coupling the two runs' noise
(a mechanical break: a round index or cohort slot out of step, a dropout,
a stream consumed differently), or the noise stays coupled and the
training amplifies the small differences the mechanisms leave (the grid's
rounding, the Skellam's shape, z 1.0003 against 1).

This probe separates them. It plays the benchmark's runs (``digits``, 500
clients, q 0.05, 25 bits, z matched to RDP's ε, seeded noise with
``MESHKIT_BENCH_COMMON_NOISE``, the same pipeline: two local workers,
SecAgg+, the clients' Skellam shares) with a client learning rate so small
(``--lr``) that the updates are about a millionth of the noise, and
``outer_optimizer = "average"``: a run's model after T rounds is then its
initial model plus the sum of its T rounds' noise over m, and nothing
amplifies anything. For each run length T in ``--rounds`` (a central and a
distributed run each), the difference of two lengths' final models is the
noise those rounds added; the probe prints, per window of rounds, the
correlation of the two runs' summed noise over the 2,410 coordinates and
their relative distance ‖n_c − n_d‖/‖n_c‖. A window whose noise is coupled
reads r > 0.9999; one whose coupling broke, r near 0 (independent noise).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import meshkit
from meshkit.privacy import COMMON_NOISE_ENV, epsilon_rdp
from meshkit.task import create_task

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distributed_dp import config, matching_z  # noqa: E402  (the benchmark's own settings)


def _flat(state: dict[str, Any]) -> np.ndarray:
    return np.concatenate([np.asarray(state[k], np.float64).ravel() for k in sorted(state)
                           if np.issubdtype(np.asarray(state[k]).dtype, np.floating)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=300)
    parser.add_argument("--clients", type=int, default=500)
    parser.add_argument("--q", type=float, default=0.05)
    parser.add_argument("--rounds", default="100,200",
                        help="run lengths, comma-separated; windows between them are compared")
    parser.add_argument("--lr", type=float, default=1e-6)
    args = parser.parse_args()
    lengths = sorted({int(t) for t in args.rounds.split(",")})
    delta, bits = 1e-5, 16 + (args.clients - 1).bit_length()
    cohort = round(args.q * args.clients)
    # z matched at the benchmark's 200 rounds, whatever lengths are probed
    z_d = matching_z(epsilon_rdp([(args.q, 1.0, 200)], delta), args.q, 200, cohort, bits,
                     delta, args.clients)
    os.environ[COMMON_NOISE_ENV] = str(args.seed)  # the runs' workers inherit it
    models: dict[tuple[str, int], np.ndarray] = {}
    initial: np.ndarray | None = None
    for t in lengths:
        for kind, z, distributed in (("central", 1.0, False), ("distributed", z_d, True)):
            table = config(Path("unused"), args.seed, args.clients, args.q, t, z, distributed,
                           bits, "seeded")
            table["outer_optimizer"] = {"name": "average"}
            table["task"] = {"lr": args.lr}
            with tempfile.TemporaryDirectory() as tmp:
                table["run"]["out"] = str(Path(tmp) / "run")
                started = time.time()
                result = meshkit.run(table)
            if not result.ok:
                raise SystemExit(f"the {kind} run of {t} rounds failed")
            models[kind, t] = _flat(dict(result.state))
            print(json.dumps({"kind": kind, "rounds": t, "z": z,
                              "seconds": round(time.time() - started, 1),
                              "load": os.getloadavg()[0]}), flush=True)
        if initial is None:  # round 0's model: the task's init from the run seed, as both runs
            task = create_task("digits", {"lr": args.lr})
            initial = _flat(dict(task.init_state(args.seed)))
    assert initial is not None
    starts = [0, *lengths[:-1]]
    for first, last in zip(starts, lengths):
        base_c = initial if first == 0 else models["central", first]
        base_d = initial if first == 0 else models["distributed", first]
        n_c = models["central", last] - base_c
        n_d = models["distributed", last] - base_d
        print(json.dumps({
            "window": [first + 1, last], "seed": args.seed, "distributed_z": z_d,
            "noise_norm_central": float(np.linalg.norm(n_c)),
            "noise_norm_distributed": float(np.linalg.norm(n_d)),
            "correlation": float(np.corrcoef(n_c, n_d)[0, 1]),
            "relative_distance": float(np.linalg.norm(n_c - n_d) / np.linalg.norm(n_c)),
            # independent noise would read about √2, fully coupled noise z_d − 1 or less
            "independent_would_read": math.sqrt(2)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
