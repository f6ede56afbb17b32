"""Private rounds fold per worker (the batched round): the same bits, ε and clip counts as the
per-client round, and a worker that does not clip is bounded as its clients would be."""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import pytest

import meshkit
from meshkit.privacy import ClippedSum
from meshkit.testing.support import assert_states_identical
from meshkit.train import LocalPool, StrategyContext
from meshkit.train._rounds import engine as _engine

CLIENTS, FRACTION = 40, 0.5


class Recording:
    """A privacy mechanism, with each round's fold and clip count kept."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.folds, self.counts = inner, [], []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def begin(self, reference: Any, **kw: Any) -> Any:
        self.folds.append(self.inner.begin(reference, **kw))
        return self.folds[-1]

    def finish(self, fold: Any, q: float, *, unclipped: int | None = None, **kw: Any) -> None:
        self.counts.append(fold.unclipped if unclipped is None else unclipped)
        self.inner.finish(fold, q, unclipped=unclipped, **kw)


def _play(monkeypatch: pytest.MonkeyPatch, *, batched: bool, placement: str = "coordinator",
          adaptive: bool = False, rounds: int = 3) -> dict[str, Any]:
    """One in-process private run (two workers); what it released and how it was folded."""
    def task() -> Any:
        return meshkit.plugins.create("task", "digits", {"lr": 0.5})

    if adaptive:
        privacy = meshkit.plugins.create("privacy", "dp-adaptive", {
            "clip": placement, "initial_clip_norm": 1.0, "clip_lr": 0.2,
            "target_quantile": 0.5, "noise_multiplier": 0.5,
            "count_noise_multiplier": 1e-3, "noise": "seeded", "accountant": "rdp"})
    else:
        privacy = meshkit.plugins.create("privacy", "dp-fixed", {
            "clip": placement, "clip_norm": 1.0, "noise_multiplier": 0.7, "noise": "seeded"})
    privacy = Recording(privacy)
    paths: list[str] = []
    pool = LocalPool.of(task, (1, 2))
    reports: list[Any] = []
    ctx = StrategyContext(
        task=task(), aggregator=meshkit.plugins.create("aggregator", "fedavg"), pool=pool,
        workers=[1, 2], rng=np.random.default_rng(0), seed=4, privacy=privacy,
        outer=meshkit.plugins.create("outer_optimizer", "average"),
        on_round=lambda report, state: reports.append(report))
    federated = meshkit.plugins.create("strategy", "federated", {
        "rounds": rounds, "clients": CLIENTS, "fraction": FRACTION, "sampling": "poisson"})
    with monkeypatch.context() as patch:
        if not batched:
            patch.setattr(_engine, "batch_applies", lambda *a, **k: False)
        path = _engine.round_path
        patch.setattr(_engine, "round_path",
                      lambda call: paths.append(path(call).name) or path(call))
        result = federated.run(ctx)
    return {"state": result.state, "epsilon": [r.metrics["epsilon"] for r in reports],
            "clip": [r.metrics["clip_norm"] for r in reports], "counts": privacy.counts,
            "paths": paths, "ops": [request["op"] for _, request in pool.log],
            "cohorts": [r.metrics["cohort"] for r in reports]}


@pytest.mark.parametrize("placement", ["coordinator", "client"])
def test_a_private_round_folds_per_worker_to_the_per_client_rounds_bits(monkeypatch, placement):
    flat = _play(monkeypatch, batched=False, placement=placement)
    batched = _play(monkeypatch, batched=True, placement=placement)
    assert flat["paths"] == ["flat"] * 3 and batched["paths"] == ["batched"] * 3
    # per worker: fits in batches and one partial each; no client's model crosses alone
    assert "take" not in batched["ops"] and "fit" not in batched["ops"]
    assert batched["ops"].count("take_partial") == 6  # two workers, three rounds
    # per client: each fit's model comes back alone (with its fit: a small model)
    assert "fit" in flat["ops"] and "take_partial" not in flat["ops"]
    # the same noise seed: the same model, bit for bit (the sums are exact integers)
    assert_states_identical(batched["state"], flat["state"], what="batched vs per-client")
    # the accountant is untouched: the same epsilon after every round
    assert batched["epsilon"] == flat["epsilon"] and batched["cohorts"] == flat["cohorts"]
    assert batched["counts"] == flat["counts"]


@pytest.mark.parametrize("placement", ["coordinator", "client"])
def test_adaptive_clipping_counts_the_same_bits_when_workers_fold(monkeypatch, placement):
    flat = _play(monkeypatch, batched=False, placement=placement, adaptive=True, rounds=4)
    batched = _play(monkeypatch, batched=True, placement=placement, adaptive=True, rounds=4)
    assert batched["paths"] == ["batched"] * 4
    # some updates within S, some not: the count is what moves S
    assert any(0 < c < n for c, n in zip(batched["counts"], batched["cohorts"]))
    assert batched["counts"] == flat["counts"]
    assert batched["clip"] == flat["clip"] and len(set(batched["clip"])) == 4
    assert_states_identical(batched["state"], flat["state"], what="batched vs per-client")


def test_a_worker_that_does_not_clip_moves_the_sum_no_more_than_its_clients(
        monkeypatch, caplog):
    clip = 1e-3  # far below digits' update norms at lr 0.5: every update is clipped
    add = ClippedSum.add

    def dishonest(self: ClippedSum, state: Any, weight: float = 1.0, *,
                  source: str | None = None) -> float:
        self.bound = math.inf  # the worker's own sum: it does not clip
        return add(self, state, weight, source=source)

    # The coordinator only merges in a batched round: only the workers' sums
    # (ClippedSum.add) skip the clip.
    monkeypatch.setattr(ClippedSum, "add", dishonest)
    privacy = Recording(meshkit.plugins.create("privacy", "dp-fixed", {
        "clip_norm": clip, "noise_multiplier": 1e-3, "noise": "seeded", "accountant": "rdp"}))

    def task() -> Any:
        return meshkit.plugins.create("task", "digits", {"lr": 0.5})

    ctx = StrategyContext(
        task=task(), aggregator=meshkit.plugins.create("aggregator", "fedavg"),
        pool=LocalPool.of(task, (1, 2)), workers=[1, 2], rng=np.random.default_rng(0), seed=4,
        privacy=privacy, outer=meshkit.plugins.create("outer_optimizer", "average"))
    federated = meshkit.plugins.create("strategy", "federated", {
        "rounds": 1, "clients": CLIENTS, "fraction": FRACTION, "sampling": "poisson"})
    with caplog.at_level(logging.WARNING):
        result = federated.run(ctx)
    fold = privacy.folds[0]
    start = fold.reference
    assert caplog.text.count("its sender did not clip") == 2  # each worker's partial
    assert fold.count >= 4 and not fold.norms  # merged partials, nothing added here
    # m x (released - start) = the clipped sum + the noise (z S per coordinate)
    moved = math.sqrt(sum(float(np.sum((result.state[k].astype(np.float64)
                                        - start[k].astype(np.float64)) ** 2))
                          for k in fold.keys)) * CLIENTS * FRACTION
    noise = 1e-3 * clip * math.sqrt(sum(start[k].size for k in fold.keys))
    assert moved <= fold.count * clip + 6 * noise
    # what the workers sent was far larger: each partial was clipped to its count x S
    assert moved > 0.5 * fold.count * clip
