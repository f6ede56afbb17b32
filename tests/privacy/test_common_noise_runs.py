"""The paired benchmark's coupling end to end: real runs, real workers on loopback.

A seeded central run and a seeded distributed run with ``MESHKIT_BENCH_COMMON_NOISE``
set release nearly the same models (their noise comes from the same uniforms, so they
differ by the grid's rounding and the Skellam's shape only); without it, the distributed
run's own Skellam streams move its model as far from the central one as independent
noise does. This is what the benchmark's workers inherit from its environment.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import meshkit
from meshkit.privacy import COMMON_NOISE_ENV

CLIENTS, BITS = 40, 22  # 16 + ⌈log₂ 40⌉


def _run(out: Path, *, distributed: bool) -> dict[str, Any]:
    table: dict[str, Any] = {
        "run": {"task": "digits", "seed": 3, "out": str(out)},
        "mesh": {"launch": "local", "workers": 2},
        "strategy": {"name": "federated", "rounds": 3, "clients": CLIENTS, "fraction": 0.25,
                     "sampling": "poisson"},
        "privacy": {"name": "dp-fixed", "clip": "client", "clip_norm": 1.0,
                    "noise_multiplier": 1.0, "noise": "seeded"},
        "outer_optimizer": {"name": "average"},
        "task": {"lr": 0.5}}
    if distributed:
        table["privacy"]["placement"] = "distributed"
        table["secure_aggregation"] = {"name": "secagg+", "modulus_bits": BITS}
    result = meshkit.run(table)
    assert result.ok
    return dict(result.state)


def _distance(a: dict[str, Any], b: dict[str, Any]) -> float:
    return math.sqrt(sum(float(np.sum((np.asarray(a[k], np.float64)
                                       - np.asarray(b[k], np.float64)) ** 2)) for k in a))


@pytest.mark.slow
def test_common_noise_couples_a_central_and_a_distributed_run(tmp_path, monkeypatch):
    monkeypatch.setenv(COMMON_NOISE_ENV, "3")
    central = _run(tmp_path / "central", distributed=False)
    coupled = _run(tmp_path / "coupled", distributed=True)
    monkeypatch.delenv(COMMON_NOISE_ENV)
    independent = _run(tmp_path / "independent", distributed=True)
    apart = _distance(central, independent)
    # three rounds of noise σ = z·S/m = 0.1 a coordinate (m = 10) over digits' 2,410
    # coordinates: the independent pair is about √(2·3·2410)·0.1 ≈ 12 apart; the coupled
    # pair differs by the grid's rounding and the Skellam's shape only (measured: 0.00075
    # against 11.8)
    assert apart > 2.0, apart
    near = _distance(central, coupled)
    assert near < 0.05 * apart, (near, apart)
