"""What a member's failure costs (meshkit.train._failures): its rank for the round, its client's
round, or -- kept failing -- its place in the run; never the run, unless accept_failures = false."""

from __future__ import annotations

import json
import math
from typing import Any

import attrs
import ml_dtypes
import numpy as np
import pytest

import meshkit.plugins
from meshkit.errors import ProtocolError, StateError, WorkerError
from meshkit.simulation import Speeds
from meshkit.train import LocalPool, RoundReport, StrategyContext, Trainer, fold_round
from meshkit.train._failures import QUARANTINE_AFTER
from meshkit.train._messages import check_contribution, nonfinite_leaf, signature

from tests.support.rounds import fits, make_ctx, same_bytes, synthetic


# -- the boundary scan -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_or_inf_anywhere_in_a_float_array_is_found(dtype, bad):
    x = np.zeros(1000, dtype)
    assert not nonfinite_leaf(x)
    x[737] = bad
    assert nonfinite_leaf(x)


@pytest.mark.parametrize("x", [np.full(4, 1e308), np.full(4, 3e38, np.float32),
                               np.full(4, 60000, np.float16), np.array([np.finfo(np.float64).max,
                                                                        -np.finfo(np.float64).max])])
def test_finite_values_whose_sum_overflows_are_not_a_false_alarm(x):
    with np.errstate(over="ignore"):
        assert not math.isfinite(float(x.sum())) or x.size == 2
    assert not nonfinite_leaf(x)


def test_integer_bool_and_empty_arrays_are_never_scanned_as_non_finite():
    for x in (np.arange(5), np.ones(3, bool), np.zeros(0)):
        assert not nonfinite_leaf(x)


def test_a_contribution_holding_nan_is_a_breach_naming_the_key():
    model = {"w": np.zeros(8, np.float32), "n": np.zeros(2, np.int64), "meta": {"a": 1}}
    bad = {**model, "w": np.array([0, 0, 0, np.nan, 0, 0, 0, 0], np.float32)}
    with pytest.raises(ProtocolError, match=r"rank 3's fit: 'w' holds NaN or inf"):
        check_contribution(bad, signature(model), "rank 3's fit")
    scalar = {**model, "w": np.ones((), np.float32)}  # a 0-d array where a vector belongs
    with pytest.raises(ProtocolError, match=r"'w' is an array float32\[\] where the model has "
                                            r"an array float32\[8\]"):
        check_contribution(scalar, signature(model), "rank 3's fit")
    check_contribution(model, signature(model), "rank 3's fit")


@pytest.mark.parametrize("dtype, limit", [(np.float64, 1.34e154), (np.float32, 1.84e19),
                                          (ml_dtypes.bfloat16, 1.84e19)])
def test_under_the_strict_means_limit_a_value_beyond_it_is_out_of_range(dtype, limit):
    from meshkit.aggregation import MeanFold

    model = {"w": np.zeros(70_000, dtype), "n": np.zeros(2, np.int64)}
    fold = MeanFold()
    good = {**model, "w": np.full(70_000, limit * 0.9, dtype)}  # whose squares overflow
    check_contribution(good, signature(model), "rank 3's fit", limit=fold.value_limit)
    bad = {**model, "w": good["w"].copy()}
    bad["w"][69_999] = dtype(limit * 2) if dtype is not np.float64 else 1e308
    with pytest.raises(ProtocolError, match=r"rank 3's fit: 'w' is out of range: it holds "):
        check_contribution(bad, signature(model), "rank 3's fit", limit=fold.value_limit)
    bad["w"][3] = np.nan
    with pytest.raises(ProtocolError, match=r"'w' holds NaN or inf"):
        check_contribution(bad, signature(model), "rank 3's fit", limit=fold.value_limit)
    # Without a limit (a robust rule's round) a finite value is the rule's to judge.
    bad["w"][3] = 0
    check_contribution(bad, signature(model), "rank 3's fit")


# -- a hostile rank in process (the real-process proof: test_failures_processes.py) --------


class Tampering(Trainer):
    """A trainer whose every fit result has NaN in its first array (a hostile or broken node)."""

    def _fit(self, request: Any) -> Any:
        state, examples, metrics, attacked = super()._fit(request)
        key = next(iter(state))
        state[key] = state[key].copy()
        state[key][0] = np.nan
        return state, examples, metrics, attacked


class Huge(Trainer):
    """A trainer whose every fit result holds its dtype's largest value in its first array
    (finite, and out of the strict mean's range: 3.4e38 beyond a float32 sum's 1.84e19)."""

    def _fit(self, request: Any) -> Any:
        state, examples, metrics, attacked = super()._fit(request)
        key = next(iter(state))
        state[key] = np.full_like(state[key], np.finfo(state[key].dtype).max)
        return state, examples, metrics, attacked


def hostile_ctx(workers: int = 4, bad: int = 2, hostile: type = Tampering,
                aggregator: str = "fedavg") -> StrategyContext:
    ctx = make_ctx(workers=workers, aggregator=aggregator)
    ctx.pool = LocalPool({r: (hostile if r == bad else Trainer)(synthetic())
                          for r in ctx.workers})
    return ctx


@pytest.mark.parametrize("aggregator", ["fedavg", "allreduce"])
def test_a_value_out_of_the_means_range_drops_its_rank_and_the_bits_are_an_honest_rounds(
        aggregator):
    # Issue 34: under the strict mean one worker's 1e308 was averaged into the model.
    state = make_ctx().task.init_state(0)
    ctx = hostile_ctx(hostile=Huge, aggregator=aggregator)
    folded = fold_round(ctx, fits(4), state=state, batch=False, weight=lambda reply: 1.0)
    assert list(folded.failed) == [2] and "is out of range: it holds 3.4e+38" in folded.failed[2]
    assert folded.not_served == {} and 2 not in folded.served.values()
    honest = fold_round(make_ctx(aggregator=aggregator), fits(4), state=state, batch=False,
                        weight=lambda reply: 1.0)
    assert same_bytes(folded.result, honest.result)


def test_under_a_robust_rule_a_value_out_of_the_means_range_is_the_rules_to_judge():
    state = make_ctx().task.init_state(0)
    folded = fold_round(hostile_ctx(hostile=Huge, aggregator="median"), fits(4), state=state,
                        batch=False)
    assert folded.failed == {} and 2 in folded.served.values()


def test_a_nan_contribution_drops_its_rank_for_the_round_and_the_bits_are_an_honest_rounds():
    state = make_ctx().task.init_state(0)
    ctx = hostile_ctx()
    folded = fold_round(ctx, fits(4), state=state, batch=False)
    assert list(folded.failed) == [2] and "holds NaN or inf" in folded.failed[2]
    assert ctx.dead == {} and folded.not_served == {} and 2 not in folded.served.values()
    assert same_bytes(folded.result, fold_round(make_ctx(), fits(4), state=state,
                                                batch=False).result)


def test_without_accept_failures_a_nan_contribution_stops_the_run_naming_rank_and_reason():
    ctx = hostile_ctx()
    ctx.accept_failures = False
    with pytest.raises(WorkerError, match=r"rank 2: protocol error: .*holds NaN or inf"):
        fold_round(ctx, fits(4), state=ctx.task.init_state(0), batch=False)


def test_a_rank_failing_in_three_rounds_is_quarantined_for_the_run():
    reports: list[RoundReport] = []
    ctx = hostile_ctx()
    ctx.on_round = lambda report, state: reports.append(report)
    result = meshkit.plugins.create("strategy", "federated",
                                    {"rounds": QUARANTINE_AFTER + 1, "clients": 4}).run(ctx)
    assert result.rounds == QUARANTINE_AFTER + 1
    assert [list(r.failed) for r in reports] == [[2]] * QUARANTINE_AFTER + [[]]
    assert ctx.dead[2].startswith(f"quarantined: failed in {QUARANTINE_AFTER} rounds (last: "
                                  f"protocol error")
    assert reports[QUARANTINE_AFTER - 1].dropped == (2,)
    assert all(r.not_served == {} for r in reports)


def test_a_client_that_stalls_every_worker_is_its_own_failure_after_two():
    # A client whose fit hangs (a deterministic bug): the pool's deadline loses the rank
    # fitting it; a second rank lost on the same client makes it the client's failure.
    ctx = make_ctx(workers=4, fail=lambda rank, request: "no reply within 60 s"
                   if request.get("op") == "fit" and request.get("shard") == 1 else None)
    folded = fold_round(ctx, fits(4), state=ctx.task.init_state(0), batch=False)
    assert list(folded.not_served) == [1]
    assert folded.not_served[1].startswith("failed on 2 ranks, so the failure is its own")
    assert len(ctx.dead) == 2 and sorted(folded.served) == [0, 2, 3]
    # Each try costs a worker: the next round does not try it again.
    again = fold_round(ctx, fits(4, rnd=2), state=ctx.task.init_state(0), batch=False)
    assert again.not_served == {1: f"quarantined: {folded.not_served[1]}"}
    assert len(ctx.dead) == 2 and sorted(again.served) == [0, 2, 3]


# -- a diverging run ---------------------------------------------------------------------


class Diverging:
    """synthetic, whose fits report a NaN loss from the second round on (a diverged model)."""

    def __init__(self) -> None:
        self.inner = synthetic()
        self.starts: list[bytes] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def fit(self, state: Any, x: Any, y: Any, *, seed: int) -> Any:
        start = next(iter(state.values())).tobytes()
        if start not in self.starts:
            self.starts.append(start)
        result = self.inner.fit(state, x, y, seed=seed)
        if len(self.starts) >= 2:
            return attrs.evolve(result, metrics={"train_loss": math.nan})
        return result


@pytest.mark.parametrize("batch_clients", [2, 8])  # flat (a client a worker), batched
def test_a_fits_nonfinite_metrics_follow_on_nonfinite(batch_clients):
    def run(on_nonfinite: str) -> tuple[Any, list[RoundReport]]:
        reports: list[RoundReport] = []
        ctx = make_ctx(workers=2, task=Diverging)
        ctx.on_round = lambda report, state: reports.append(report)
        strategy = meshkit.plugins.create("strategy", "federated", {
            "rounds": 3, "clients": batch_clients, "on_nonfinite": on_nonfinite})
        return strategy.run(ctx), reports

    with pytest.raises(StateError, match=r"round 2: rank \d: fit: the task's fit reported "
                                         r"train_loss = nan.*the last checkpoint \(round 1\)"):
        run("stop")
    result, reports = run("skip-round")
    assert [r.round for r in reports] == [1, 2, 3]
    assert reports[0].skipped == "" and reports[1].skipped.startswith("a fit diverged")
    assert "kept the round 1 model" in reports[1].skipped


# -- strict JSON -------------------------------------------------------------------------


def test_metrics_lines_and_the_summary_are_strict_json():
    report = RoundReport(1, 1, "federated", answered=(1,), metrics={"train_loss": math.nan,
                                                                    "accuracy": 0.5},
                         client_metrics={3: {"loss": math.inf}}, failed={2: "error: x"})
    line = report.to_json()
    assert line["train_loss"] is None and line["accuracy"] == 0.5
    assert line["client_metrics"] == {"3": {"loss": None}} and line["failed"] == {"2": "error: x"}
    json.dumps(line, allow_nan=False)
    from meshkit.train import RunReport

    summary = RunReport(ok=True, out="o", strategy="federated", rounds=1, rounds_completed=1,
                        metrics={"loss": math.nan}, history=(report,)).to_json()
    assert summary["metrics"] == {"loss": None}
    assert summary["failed"] == {"2": ["round 1: error: x"]}
    json.dumps(summary, allow_nan=False)


# -- fedbuff -----------------------------------------------------------------------------


class Refusing(Trainer):
    """A trainer whose every fit is an ``error`` reply (a broken or hostile node)."""

    def _fit(self, request: Any) -> Any:
        raise RuntimeError("this node refuses")


@pytest.mark.parametrize("hostile", [Refusing, Tampering])
@pytest.mark.parametrize("virtual", [False, True])
def test_fedbuff_finishes_every_step_with_one_hostile_rank(hostile, virtual):
    ranks = [1, 2, 3]
    reports: list[RoundReport] = []
    task = synthetic()
    ctx = StrategyContext(
        task=task, aggregator=meshkit.plugins.create("aggregator", "fedavg"),
        pool=LocalPool({r: (hostile if r == 2 else Trainer)(synthetic()) for r in ranks}),
        workers=ranks, rng=np.random.default_rng(0),
        outer=meshkit.plugins.create("outer_optimizer", "average"),
        on_round=lambda report, state: reports.append(report))
    if virtual:
        ctx.speeds = Speeds(seed=0, sigma=0.5)
    strategy = meshkit.plugins.create("strategy", "fedbuff", {
        "rounds": 4, "clients": 6, "buffer_size": 2, "concurrency": 3})
    result = strategy.run(ctx)
    assert result.rounds == 4 and [r.round for r in reports] == [1, 2, 3, 4]
    assert any(r.failed.get(2) for r in reports)
    assert all(2 not in r.served.values() for r in reports)
    assert all(set(r.failed) <= {2} for r in reports)
    assert ctx.strikes[2] == sum(2 in r.failed for r in reports)


@pytest.mark.parametrize("virtual", [False, True])
def test_fedbuff_under_the_strict_mean_drops_a_value_out_of_its_range_naming_the_rank(virtual):
    # Issue 34: fedbuff folded one worker's 1e308 (here float32's 3.4e38) into its buffer.
    ranks = [1, 2, 3]
    reports: list[RoundReport] = []
    ctx = StrategyContext(
        task=synthetic(), aggregator=meshkit.plugins.create("aggregator", "fedavg"),
        pool=LocalPool({r: (Huge if r == 2 else Trainer)(synthetic()) for r in ranks}),
        workers=ranks, rng=np.random.default_rng(0),
        outer=meshkit.plugins.create("outer_optimizer", "average"),
        on_round=lambda report, state: reports.append(report))
    if virtual:
        ctx.speeds = Speeds(seed=0, sigma=0.5)
    strategy = meshkit.plugins.create("strategy", "fedbuff", {
        "rounds": 3, "clients": 6, "buffer_size": 2, "concurrency": 3})
    result = strategy.run(ctx)
    assert result.rounds == 3 and [r.round for r in reports] == [1, 2, 3]
    assert any("is out of range" in r.failed.get(2, "") for r in reports)
    assert all(2 not in r.served.values() for r in reports)
    assert all(np.isfinite(v).all() and np.abs(v).max() < 1e6
               for v in result.state.values() if isinstance(v, np.ndarray))


def test_a_reply_carrying_an_error_payload_is_not_ok():
    # GroupPool hands an ``error`` reply over as answered; only ctx.call read it as failed.
    from meshkit.train import Reply
    assert Reply(2, {"error": "this node refuses", "seq": 1}, None, 1).ok is False
    assert Reply(2, None, "lost", 1).ok is False
    assert Reply(2, {"examples": 3}, None, 1).ok is True


# -- plain requests (StrategyContext.call / broadcast) -----------------------------------


def digits() -> Any:
    return meshkit.plugins.create("task", "digits", {"hidden": 8})


class NoEvaluation(Trainer):
    """A trainer whose every ``evaluate`` is an ``error`` reply."""

    def handle(self, request: Any) -> dict[str, Any]:
        if request.get("op") == "evaluate":
            return {"error": "evaluate: this node refuses", "seq": request["seq"]}
        return super().handle(request)


def test_an_error_reply_to_a_plain_request_is_the_rounds_failure_not_the_runs():
    ranks = [1, 2, 3]
    reports: list[RoundReport] = []
    ctx = make_ctx(workers=3, task=digits)
    ctx.pool = LocalPool({r: (NoEvaluation if r == 2 else Trainer)(digits()) for r in ranks})
    ctx.on_round = lambda report, state: reports.append(report)
    strategy = meshkit.plugins.create("strategy", "federated", {
        "rounds": 2, "clients": 3, "evaluate": "clients"})
    strategy.run(ctx)
    assert [r.failed for r in reports] == [{2: "error: evaluate: this node refuses"}] * 2
    assert all(sorted(r.client_metrics) == [0, 2] and r.partial_means for r in reports)
    assert ctx.dead == {} and ctx.strikes == {2: 2}
    ctx = make_ctx(workers=3, task=digits)
    ctx.pool = LocalPool({r: (NoEvaluation if r == 2 else Trainer)(digits()) for r in ranks})
    with pytest.raises(WorkerError, match="rank 2: evaluate: this node refuses"):
        meshkit.plugins.create("strategy", "federated", {
            "rounds": 2, "clients": 3, "evaluate": "clients",
            "accept_failures": False}).run(ctx)


# -- what the scan costs an honest round ---------------------------------------------------


def test_the_strict_mean_scans_nothing_in_an_honest_round_and_replays_a_poisoned_one(
        monkeypatch):
    import meshkit.train._messages.check as messages

    scans: list[int] = []
    real, ranged = messages.nonfinite_leaf, messages.out_of_range_leaf
    monkeypatch.setattr(messages, "nonfinite_leaf", lambda x: scans.append(1) or real(x))
    # The strict mean's replay scans NaN and its range in one pass.
    monkeypatch.setattr(messages, "out_of_range_leaf",
                        lambda x, limit: scans.append(1) or ranged(x, limit))
    state = make_ctx().task.init_state(0)
    honest = make_ctx()
    fold_round(honest, fits(4), state=state, batch=False)
    assert scans == []  # fedavg's fold finds NaN itself while it sums: no second pass
    ctx = hostile_ctx()
    folded = fold_round(ctx, fits(4), state=state, batch=False)
    assert scans and list(folded.failed) == [2]
    set_states = [r for r, request in ctx.pool.log
                  if request.get("op") == "set_state" or request.get("set_state")]
    assert len(set_states) == 8  # the round was played twice: once refused, once scanned
    median = make_ctx(aggregator="median")
    scans.clear()
    fold_round(median, fits(4), state=state)
    assert len(scans) == 4 * len(state)  # a robust rule's contributions are scanned


class Scalar(Trainer):
    """A trainer whose every fit result has a 0-d array where the model has a vector."""

    def _fit(self, request: Any) -> Any:
        state, examples, metrics, attacked = super()._fit(request)
        key = next(iter(state))
        state[key] = np.ones((), state[key].dtype)
        return state, examples, metrics, attacked


def test_a_0d_array_in_a_batched_round_is_its_ranks_failure_at_once_named():
    state = make_ctx().task.init_state(0)
    ctx = make_ctx(workers=3)
    ctx.pool = LocalPool({r: (Scalar if r == 2 else Trainer)(synthetic()) for r in ctx.workers})
    folded = fold_round(ctx, fits(6), state=state)
    assert "fit_batch" in [request.get("op") for _, request in ctx.pool.log]
    assert list(folded.failed) == [2] and ctx.dead == {}
    assert "'w0' is an array float32[] where the model has an array float32[2048]" in \
        folded.failed[2]
    assert folded.not_served == {} and 2 not in folded.served.values()
    expected = fold_round(make_ctx(workers=3), fits(6), state=state)
    assert same_bytes(folded.result, expected.result)


def test_without_accept_failures_a_stall_stops_the_round_too():
    for batch in (False, True):
        ctx = make_ctx(workers=3, fail=lambda rank, request: "no reply within 30 s"
                       if rank == 2 and request.get("op") in ("fit", "fit_batch") else None)
        ctx.accept_failures = False
        with pytest.raises(WorkerError, match="rank 2: no reply within 30 s"):
            fold_round(ctx, fits(6), state=ctx.task.init_state(0), batch=batch)


def test_a_client_that_stalls_every_worker_in_a_batched_round_is_found_by_name():
    # A batch holding it stalls (which client is not known): its clients are served again
    # one by one, and the one that stalls a second rank alone is its own failure.
    def stalls(rank: int, request: Any) -> str | None:
        fits = request.get("fits", [])
        return "no reply within 60 s" if any(f["shard"] == 5 for f in fits) else None

    ctx = make_ctx(workers=4, fail=stalls)
    folded = fold_round(ctx, fits(16), state=ctx.task.init_state(0))
    assert "fit_batch" in [request.get("op") for _, request in ctx.pool.log]
    assert list(folded.not_served) == [5]
    assert folded.not_served[5].startswith("failed on 2 ranks, so the failure is its own")
    assert len(ctx.dead) == 2 and sorted(folded.served) == [c for c in range(16) if c != 5]
    again = fold_round(ctx, fits(16, rnd=2), state=ctx.task.init_state(0))
    assert again.not_served == {5: f"quarantined: {folded.not_served[5]}"}
    assert len(ctx.dead) == 2
    expected = fold_round(make_ctx(workers=2), [w for w in fits(16) if w.key != 5],
                          state=ctx.task.init_state(0))
    assert same_bytes(folded.result, expected.result)
