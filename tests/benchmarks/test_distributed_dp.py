"""``benchmarks/distributed_dp.py --paired``'s summary: the pairing and the coupling checks
(issue 41), on saved runs written here."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 60


def _benchmark():
    spec = importlib.util.spec_from_file_location("distributed_dp_benchmark",
                                                  ROOT / "benchmarks" / "distributed_dp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _save(folder: Path, kind: str, seed: int, accuracy: np.ndarray, noise: str = "common",
          cohort: list[float] | None = None) -> None:
    line = {"kind": kind, "seed": seed, "ok": True, "rounds": ROUNDS, "noise": noise,
            "accuracy": [float(a) for a in accuracy],
            "cohort": cohort or [25.0] * ROUNDS}
    (folder / f"{kind}-{seed}.json").write_text(json.dumps(line) + "\n")


def _walk(rng: np.random.Generator) -> np.ndarray:
    return 0.5 + np.cumsum(rng.normal(0, 0.01, ROUNDS))


def test_coupled_pairs_are_summarised_with_their_correlations(tmp_path):
    bench = _benchmark()
    rng = np.random.default_rng(0)
    for seed in range(4):
        central = _walk(rng)
        _save(tmp_path, "central", seed, central)
        _save(tmp_path, "distributed-at-pld", seed,
              central - 0.01 + rng.normal(0, 0.002, ROUNDS))
    out = bench.summarise(tmp_path, 20, ROUNDS, ["pld"])
    gap = out["gap_points_pld"]
    assert gap["n"] == 4 and gap["mean"] == pytest.approx(1.0, abs=0.2)
    assert gap["step_correlation_first_50"]["min"] > 0.9
    assert gap["score_correlation"] > 0.9
    # --window: the same pairs scored over rounds 1 to 10
    early = bench.summarise(tmp_path, 20, ROUNDS, ["pld"], window=(1, 10))["gap_points_pld"]
    central = json.loads((tmp_path / "central-0.json").read_text())["accuracy"]
    dist = json.loads((tmp_path / "distributed-at-pld-0.json").read_text())["accuracy"]
    assert early["per_seed"][0] == pytest.approx(100 * (np.mean(central[:10])
                                                        - np.mean(dist[:10])))


def test_a_common_noise_pair_that_was_not_coupled_stops_the_summary(tmp_path):
    bench = _benchmark()
    rng = np.random.default_rng(1)
    for seed in range(3):
        _save(tmp_path, "central", seed, _walk(rng))
        _save(tmp_path, "distributed-at-pld", seed, _walk(rng))  # independent walks
    with pytest.raises(SystemExit, match="the noise was not coupled"):
        bench.summarise(tmp_path, 20, ROUNDS, ["pld"])
    # the same runs read as the independent design are summarised, not checked
    for path in tmp_path.glob("*.json"):
        line = json.loads(path.read_text())
        path.write_text(json.dumps(line | {"noise": "independent"}))
    assert bench.summarise(tmp_path, 20, ROUNDS, ["pld"], "independent")["gap_points_pld"]["n"] == 3
    # and never paired with a common-noise run
    assert "gap_points_pld" not in bench.summarise(tmp_path, 20, ROUNDS, ["pld"])


def test_a_pair_with_different_cohorts_is_not_a_paired_design(tmp_path):
    bench = _benchmark()
    walk = _walk(np.random.default_rng(2))
    _save(tmp_path, "central", 0, walk)
    _save(tmp_path, "distributed-at-pld", 0, walk, cohort=[24.0] + [25.0] * (ROUNDS - 1))
    with pytest.raises(SystemExit, match="sampled different cohorts"):
        bench.summarise(tmp_path, 20, ROUNDS, ["pld"])
