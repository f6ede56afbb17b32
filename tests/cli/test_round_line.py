"""The progress line of one round says who was dropped, what was not served, and who joined."""

from __future__ import annotations

from meshkit.train import RoundReport
from meshkit.train import format_round as _round_line


def _report(**fields):
    return RoundReport(round=2, rounds=5, strategy="federated", answered=(1, 3),
                       metrics={"train_loss": 0.5}, seconds=1.25, **fields)


def test_a_clean_round_says_only_its_workers_metrics_and_time():
    assert _round_line(_report(clients=(0, 1))) == (
        "round   2/5  workers 2/2  train_loss 0.5000  1.25s")


def test_clients_not_served_late_and_joined_ranks_are_on_the_line():
    line = _round_line(_report(clients=(0, 1), not_served={2: "late: no answer", 3: "lost"},
                               late=(2,), dropped={2: "gone"}, joined=(4,)))
    assert "workers 2/3" in line and "(dropped rank 2)" in line
    assert "(2 of 4 client(s) not served, 1 late; see metrics.jsonl)" in line
    assert line.endswith("(joined rank 4)")


def test_an_asynchronous_step_shows_its_largest_staleness_and_the_virtual_clock():
    line = _round_line(_report(clients=(0, 1), staleness={0: 1, 3: 1}, simulated_time=42.25))
    assert line.endswith("(staleness up to 3, simulated 42.2s)")
    assert _round_line(_report(clients=(0,), staleness={2: 1})).endswith("(staleness up to 2)")


def test_an_asynchronous_step_counts_the_live_workers_not_the_ranks_its_buffer_came_from():
    # Issue 35, item 9: a step whose 2 updates both came from rank 1 said "workers 1/1"
    # while both workers were alive and training.
    line = _round_line(RoundReport(round=3, rounds=200, strategy="fedbuff", answered=(1,),
                                   clients=(4, 9), staleness={0: 1, 1: 1}, live=(1, 2),
                                   metrics={"train_loss": 0.5}, seconds=0.5))
    assert line.startswith("round   3/200  workers 2/2 live, 2 update(s) from rank 1  ")
    lost = _round_line(RoundReport(round=4, rounds=200, strategy="fedbuff", answered=(1,),
                                   clients=(4,), staleness={0: 1}, live=(1,), dropped=(2,),
                                   metrics={}, seconds=0.5))
    assert "workers 1/2 live, 1 update(s) from rank 1" in lost and "(dropped rank 2)" in lost
