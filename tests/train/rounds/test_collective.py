"""A collective run: every rank plays its slice of the round, one exact sum per round.

Ranks are threads here (``tests/support/reducers.py``); the same runs under
torchrun's processes are ``tests/transport/test_torchdist_spmd.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshkit import RefusedError
import meshkit.plugins
from meshkit.train import LocalPool, Runner, RunStopped, StrategyContext, cohort_slice

from tests.support.reducers import ThreadWorld


def _tables(out: Path, **strategy: Any) -> dict[str, Any]:
    return {
        "run": {"task": "digits", "seed": 5, "out": str(out)},
        "mesh": {"workers": 2, "timeout": 10},
        "strategy": {"name": "federated", "rounds": 2, "clients": 12, "fraction": 0.5,
                     **strategy},
        "aggregator": {"name": "fedavg"},
    }


def _collective(tmp_path: Path, world: int, **strategy: Any) -> tuple[list[Any], ThreadWorld]:
    threads = ThreadWorld(world)

    def play(reducer: Any) -> Any:
        out = tmp_path / f"w{world}" / f"rank{reducer.rank}"
        return Runner(_tables(out, **strategy), collective=reducer).run()

    return threads.run(play), threads


def test_a_rank_serves_every_worldth_client_of_the_sorted_cohort() -> None:
    assert cohort_slice([9, 2, 7, 4, 1], 0, 2) == [1, 4, 9]
    assert cohort_slice([9, 2, 7, 4, 1], 1, 2) == [2, 7]
    assert cohort_slice([3], 2, 4) == []


def test_the_aggregate_is_the_same_bits_at_1_2_and_4_ranks_as_the_coordinators(
        tmp_path: Path) -> None:
    finals = {}
    for world in (1, 2, 4):
        reports, threads = _collective(tmp_path, world)
        assert all(r.ok for r in reports), [r.error for r in reports]
        assert threads.sums == 2  # one collective per round
        states = [r.state for r in reports]
        for state in states[1:]:  # every rank ends on the same model
            assert all(np.array_equal(state[k], states[0][k]) for k in states[0])
        finals[world] = states[0]
        # Who served which client is the documented slice, on every rank's report.
        history = reports[0].history
        for report in history:
            cohort = sorted(report.clients)
            assert dict(report.served) == {c: i % world for i, c in enumerate(cohort)}
            assert report.examples == sum(report.client_examples.values()) > 0
    for world in (2, 4):
        for key, value in finals[1].items():
            assert finals[world][key].dtype == value.dtype
            assert finals[world][key].tobytes() == value.tobytes(), (world, key)
    # The coordinator's round engine (two in-process workers) folds the same exact sums.
    task = lambda: meshkit.plugins.create("task", "digits")  # noqa: E731
    ctx = StrategyContext(task=task(), aggregator=meshkit.plugins.create("aggregator", "fedavg"),
                          pool=LocalPool.of(task, [1, 2]), workers=[1, 2],
                          rng=np.random.default_rng(5), seed=5, timeout=10)
    strategy = meshkit.plugins.create("strategy", "federated",
                                      {"rounds": 2, "clients": 12, "fraction": 0.5})
    coordinated = strategy.run(ctx).state
    assert all(coordinated[k].tobytes() == v.tobytes() for k, v in finals[1].items())


def test_every_rank_records_the_same_rounds(tmp_path: Path) -> None:
    reports, _ = _collective(tmp_path, 2)
    assert (tmp_path / "w2" / "rank0" / "metrics.jsonl").read_text().count("\n") == 2
    assert reports[1].history[-1].metrics == reports[0].history[-1].metrics


@pytest.mark.parametrize("tables, words", [
    ({"aggregator": {"name": "median"}}, "lacks the trait AggregatorTraits.linear"),
    ({"strategy": {"clients": 0}}, "set [strategy] clients"),
    ({"strategy": {"round_timeout": 5.0}}, "[strategy] round_timeout is not played"),
])
def test_what_a_collective_round_cannot_play_is_refused_before_any_rank_trains(
        tmp_path: Path, tables: dict[str, Any], words: str) -> None:
    config = _tables(tmp_path / "out")
    for table, values in tables.items():
        config[table] = {**config[table], **values}
    with pytest.raises(RefusedError) as caught:
        Runner(config, collective=ThreadWorld(1).reducer(0)).run()
    assert words in str(caught.value)
    assert "mode = \"coordinator\"" in str(caught.value) or "clients" in words


def test_a_stop_asked_on_one_rank_stops_every_rank_after_the_same_round(
        tmp_path: Path) -> None:
    threads = ThreadWorld(2)

    def play(reducer: Any) -> Any:
        if reducer.rank == 1:
            reducer.stop_requested.set()  # as SIGTERM does under torchrun
        runner = Runner(_tables(tmp_path / f"rank{reducer.rank}", rounds=3),
                        collective=reducer)
        with pytest.raises(RunStopped):
            runner.run()
        return runner.report

    reports = threads.run(play)
    assert [r.rounds_completed for r in reports] == [1, 1]
    assert threads.sums == 1


def test_a_population_task_plays_collectively_with_the_same_bits_at_1_and_3_ranks(
        tmp_path: Path) -> None:
    def tables(out: Path) -> dict[str, Any]:
        return {"run": {"task": "synthetic-federated", "seed": 2, "out": str(out)},
                "task": {"clients": 10_000},
                "strategy": {"name": "federated", "rounds": 2, "fraction": 0.001},
                "aggregator": {"name": "fedavg"}}

    finals = []
    for world in (1, 3):
        reports = ThreadWorld(world).run(lambda reducer: Runner(
            tables(tmp_path / f"w{world}-{reducer.rank}"), collective=reducer).run())
        assert reports[0].ok and len(reports[0].history[-1].clients) == 10
        finals.append(reports[0].state)
    assert all(finals[1][k].tobytes() == v.tobytes() for k, v in finals[0].items())


def test_a_resumed_collective_run_ends_on_the_uninterrupted_runs_bits(tmp_path: Path) -> None:
    def play(rounds: int, name: str, resume: bool) -> Any:
        return ThreadWorld(2).run(lambda reducer: Runner(
            _tables(tmp_path / name / str(reducer.rank), rounds=rounds), collective=reducer,
            resume=resume).run())[0]

    play(1, "resumed", resume=False)
    resumed = play(3, "resumed", resume=True)
    straight = play(3, "straight", resume=False)
    assert resumed.resumed_from == 1 and resumed.rounds_completed == 3
    assert all(resumed.state[k].tobytes() == v.tobytes() for k, v in straight.state.items())


def test_a_client_failing_on_its_rank_is_not_served_and_every_rank_finishes(
        tmp_path: Path) -> None:
    threads = ThreadWorld(2)

    def play(reducer: Any) -> Any:
        tables = _tables(tmp_path / f"rank{reducer.rank}", fraction=1.0)
        tables["run"]["task"] = "tests.support.hostile_task:BrokenShard"
        tables["task"] = {"broken": 3, "shards": 12}
        return Runner(tables, collective=reducer).run()

    reports = threads.run(play)
    assert all(r.ok for r in reports), [r.error for r in reports]
    owner = next(r for r in range(2) if 3 in cohort_slice(list(range(12)), r, 2))
    for rank, report in enumerate(reports):
        for row in report.history:
            assert list(row.not_served) == [3], row.not_served
            if rank == owner:  # the reason is the owner's to tell; the sum says who
                assert row.not_served[3].startswith("failed on its only worker")
                assert "client 3's data breaks this fit" in row.not_served[3]
            else:
                assert row.not_served[3] == f"rank {owner} could not serve it"
            assert sorted(row.served) == [c for c in range(12) if c != 3]
