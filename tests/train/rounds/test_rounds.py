"""The round skeleton: rounds after start_round, one report per outcome, stops between rounds."""

from __future__ import annotations

import numpy as np
import pytest

from meshkit import StateError

from meshkit.train import LocalPool, RoundOutcome, RunStopped, StrategyContext, run_rounds


def context(**kw) -> StrategyContext:
    return StrategyContext(task=None, aggregator=None, pool=LocalPool({}), workers=[1, 2],
                           rng=None, **kw)


def count_round(ctx, rnd, state):
    return RoundOutcome({"n": state["n"] + 1}, answered=(1,), clients=(rnd,),
                        examples=10 * rnd, metrics={"n": float(state["n"] + 1)},
                        served={rnd: 1}, not_served={rnd + 100: "no live worker left"})


def test_each_outcome_becomes_one_report_in_round_order_and_the_last_state_wins():
    reports = []
    ctx = context(on_round=lambda report, state: reports.append((report, dict(state))))
    result = run_rounds(ctx, "counting", 3, {"n": 0}, count_round)
    assert [(r.round, r.rounds, r.strategy) for r, _ in reports] == [
        (1, 3, "counting"), (2, 3, "counting"), (3, 3, "counting")]
    first, state = reports[0]
    assert (first.answered, first.dropped, first.clients, first.examples) == ((1,), (), (1,), 10)
    assert first.served == {1: 1} and first.not_served == {101: "no live worker left"}
    assert first.metrics == {"n": 1.0} and state == {"n": 1} and first.seconds >= 0.0
    assert (dict(result.state), result.rounds, dict(result.metrics)) == ({"n": 3}, 3, {"n": 3.0})
    line = first.to_json()
    assert line["served"] == {"1": 1} and line["not_served"] == {"101": "no live worker left"}


def test_each_report_names_the_workers_the_ledger_gained_since_the_last_one():
    ctx = context()
    reports = []
    ctx.on_round = lambda report, state: reports.append(report.dropped)

    def play(ctx, rnd, state):
        if rnd == 1:
            ctx.pool.declare_dead(2, "gone during round 1")
        if rnd == 3:
            ctx.pool.declare_dead(1, "gone during round 3")
        return count_round(ctx, rnd, state)

    run_rounds(ctx, "counting", 3, {"n": 0}, play)
    assert reports == [(2,), (), (1,)]


def test_a_resumed_run_plays_only_the_rounds_after_its_checkpoint():
    played = []

    def play(ctx, rnd, state):
        played.append(rnd)
        return count_round(ctx, rnd, state)

    result = run_rounds(context(start_round=2), "counting", 4, {"n": 2}, play)
    assert played == [3, 4] and dict(result.state) == {"n": 4}
    finished = run_rounds(context(start_round=4), "counting", 4, {"n": 4}, play)
    assert played == [3, 4] and dict(finished.state) == {"n": 4} and finished.metrics == {}


def test_a_stop_request_is_honoured_between_rounds_not_inside_one():
    ctx = context()
    played = []

    def play(ctx, rnd, state):
        played.append(rnd)
        ctx.stop.set()  # asked mid-round: this round still completes and reports
        return count_round(ctx, rnd, state)

    reports = []
    ctx.on_round = lambda report, state: reports.append(report.round)
    with pytest.raises(RunStopped, match="the last checkpoint is intact"):
        run_rounds(ctx, "counting", 5, {"n": 0}, play)
    assert played == [1] and reports == [1]


def diverging_round(ctx, rnd, state):
    """Round 2 makes the model non-finite: an overflow in one key, NaN in another."""
    w = np.full(2, np.inf if rnd == 2 else float(rnd))
    b = np.array(np.nan if rnd == 2 else 0.5, np.float32)
    return RoundOutcome({"w": w, "b": b, "steps": np.array([rnd])}, answered=(1,),
                        metrics={"train_loss": 1.0 / rnd, "loss": float("nan") if rnd == 2
                                 else 0.5})


def test_a_round_that_makes_the_model_non_finite_stops_the_run_naming_keys_and_round():
    saved = []
    ctx = context(on_round=lambda report, state: saved.append(report.round))
    with pytest.raises(StateError, match=r"round 2: the new global model is not finite "
                                         r"\(NaN or inf in 'w', 'b'\).*checkpoint \(round 1\)"
                                         r".*on_nonfinite = \"skip-round\""):
        run_rounds(ctx, "diverging", 3, {"w": np.zeros(2), "b": np.array(0.0, np.float32),
                                          "steps": np.array([0])}, diverging_round)
    assert saved == [1], "the non-finite round is never reported, so never checkpointed"


def test_skip_round_keeps_the_previous_model_and_says_so_in_the_report():
    reports = []
    ctx = context(on_round=lambda report, state: reports.append((report, dict(state))))
    result = run_rounds(ctx, "diverging", 3, {"w": np.zeros(2), "b": np.array(0.0, np.float32),
                                              "steps": np.array([0])}, diverging_round,
                        on_nonfinite="skip-round")
    second, state = reports[1]
    assert second.skipped.startswith("non-finite model ('w', 'b'); kept the round 1 model")
    assert np.array_equal(state["w"], np.ones(2)) and int(state["steps"][0]) == 1
    assert dict(second.metrics) == {"train_loss": 0.5}, "the discarded model's loss is no result"
    assert second.to_json()["skipped"] == second.skipped
    assert "skipped" not in reports[0][0].to_json()
    assert np.array_equal(result.state["w"], np.full(2, 3.0))


def test_a_row_whose_client_means_miss_a_client_says_so():
    def round_(ctx, rnd, state):
        evaluated = {0: {"accuracy": 0.9, "examples": 10.0}, 1: {"accuracy": 0.8,
                                                                 "examples": 10.0}}
        if rnd == 2:  # client 2's node is down this round
            return RoundOutcome(state, answered=(1,), clients=(0, 1), client_metrics=evaluated,
                                not_served={2: "its data is on rank 3, which is not live"})
        return RoundOutcome(state, answered=(1,), clients=(0, 1, 2), client_metrics={
            **evaluated, 2: {"accuracy": 0.2, "examples": 10.0}})

    reports = []
    ctx = context(on_round=lambda report, state: reports.append(report))
    run_rounds(ctx, "federated", 3, {"n": 0}, round_)
    assert [r.partial_means for r in reports] == [
        "", "client means over 2 of 3 clients (not evaluated: 2)", ""]
    assert reports[1].to_json()["partial_means"] == reports[1].partial_means
    assert "partial_means" not in reports[0].to_json()



def test_the_skeleton_reports_each_rounds_residual_restarts_whatever_strategy_plays():
    """``residual_restarts`` is the kernel's fact (the pins the round engine keeps), so a
    strategy that is not the built-in ``federated`` reports it too: what moved in the round."""
    from meshkit.train._rounds.pins import ResidualPins, pin

    clients = range(6)
    reports = []
    ctx = context(on_round=lambda report, state: reports.append(dict(report.metrics)))

    def play(ctx, rnd, state):
        if ctx.residual_pins is None:  # the round engine makes them on a first compressed round
            ctx.residual_pins = ResidualPins()
        live = [1] if rnd == 2 else [1, 2]  # rank 2 is lost in round 2 (and back in 3)
        planned = ctx.residual_pins.plan([(c, None) for c in clients], live)
        ctx.residual_pins.folded({c: rank for c, (rank, _) in planned.items()},
                                 {c: {"seed": rnd} for c in clients})
        return count_round(ctx, rnd, state)

    run_rounds(ctx, "third-party", 3, {"n": 0}, play)
    on_two = sum(1 for c in clients if pin(c, [1, 2]) == 2)
    assert on_two > 0
    # Round 2: rank 2's clients move to rank 1; round 3: they move back.
    assert [m["residual_restarts"] for m in reports] == [0.0, on_two, on_two]
