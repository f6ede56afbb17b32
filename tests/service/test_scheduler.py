"""The scheduler's placement bookkeeping (meshkit.service._scheduler), without a service."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshkit.service._scheduler import NodeLink, Scheduler
from meshkit.service._store import Store


def test_a_run_that_ends_before_its_start_returns_frees_its_node_for_the_next(
        tmp_path: Path) -> None:
    # Issue 40: kick() looked the run up again after start_run returned, and a run whose
    # job ended at once (run_ended on the starting thread) had already left: KeyError.
    store = Store(tmp_path / "service.db")
    started: list[str] = []

    def start_run(record: Any, ranks: dict[str, int]) -> str:
        started.append(record.id)
        if record.id == first.id:
            scheduler.run_ended(record.id)  # its job failed before start() returned
        return f"job {record.id}"

    scheduler = Scheduler(store, start_run=start_run, authorized_for=lambda record: None)
    store.node_seen("n1", public=None, caps={}, address="127.0.0.1:1")
    scheduler.nodes["n1"] = NodeLink("n1", None, channel=None, caps={}, address="127.0.0.1:1")
    first = store.add_run(name="a.toml", config="[run]", authorized=None, rounds=1, workers=1)
    second = store.add_run(name="b.toml", config="[run]", authorized=None, rounds=1, workers=1)
    scheduler.enqueue(first.id)
    assert started == [first.id] and scheduler.active(first.id) is None
    assert scheduler.nodes["n1"].busy == ""
    store.update_run(first.id, state="failed")
    scheduler.enqueue(second.id)
    assert started == [first.id, second.id]
    assert scheduler.active(second.id) == f"job {second.id}"
    assert scheduler.nodes["n1"].busy == second.id
