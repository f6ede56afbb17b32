"""The service's SQLite store: schema migrations, runs, events, nodes, the long poll."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from meshkit.errors import ConfigError
from meshkit.service._store import MIGRATIONS, SCHEMA_VERSION, Store, migrate


def test_a_version_1_database_is_migrated_with_its_runs_kept(tmp_path: Path) -> None:
    path = tmp_path / "service.db"
    db = sqlite3.connect(path, isolation_level=None)
    migrate(db, upto=1)
    db.execute("INSERT INTO runs (id, seq, name, config, state, submitted, rounds, workers) "
               "VALUES ('r1', 1, 'old.toml', '[run]', 'running', 1.0, 5, 2)")
    db.execute("INSERT INTO nodes (id, first_seen, last_seen, connected) VALUES "
               "('SHA256:x', 1.0, 2.0, 1)")
    db.close()

    store = Store(path)
    assert store.migrated_from == 1
    (version,) = sqlite3.connect(path).execute("PRAGMA user_version").fetchone()
    assert version == SCHEMA_VERSION == len(MIGRATIONS)
    run = store.run("r1")
    assert run is not None and run.name == "old.toml" and run.state == "running"
    assert run.stop_requested is False  # the column version 2 added, with its default
    (node,) = store.nodes()
    assert node.id == "SHA256:x" and node.runs_served == 0 and node.busy_run is None
    store.close()


def test_a_database_from_a_newer_meshkit_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "service.db"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(ConfigError, match=r"schema version \d+ is newer than this meshkit's"):
        Store(path)


def test_a_file_that_is_not_a_database_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "service.db"
    path.write_bytes(b"not sqlite at all" * 100)
    with pytest.raises(ConfigError, match="not a meshkit service database"):
        Store(path)


def test_runs_events_and_nodes_round_trip(tmp_path: Path) -> None:
    store = Store(tmp_path / "service.db")
    first = store.add_run(name="a.toml", config="[run]", authorized=None, rounds=3, workers=2)
    second = store.add_run(name="b.toml", config="[run]", authorized="key", rounds=1, workers=1)
    assert (first.id, second.id, first.state) == ("r1", "r2", "queued")
    store.update_run("r1", state="running", rounds_completed=2, result={"ok": True})
    assert [r.id for r in store.runs(("running",))] == ["r1"]
    assert store.run("r1").result == {"ok": True}  # type: ignore[union-attr]
    assert store.add_event("r1", "round", "round 1", {"round": 1}) == 1
    assert store.add_event("r1", "round", "round 2", {"round": 2}) == 2
    assert [e.data for e in store.events("r1", after=1)] == [{"round": 2}]
    store.node_seen("SHA256:a", public="ssh-ed25519 AAAA", caps={"rank": 1}, address="h:1")
    store.update_node("SHA256:a", busy_run="r1", served=True)
    (node,) = store.nodes()
    assert (node.connected, node.busy_run, node.runs_served) == (True, "r1", 1)
    store.disconnect_all()
    assert store.nodes()[0].connected is False
    with pytest.raises(ValueError, match="not a run column"):
        store.update_run("r1", name="x")


def test_the_long_poll_wakes_when_an_event_arrives(tmp_path: Path) -> None:
    store = Store(tmp_path / "service.db")
    store.add_run(name="a.toml", config="[run]", authorized=None, rounds=3, workers=1)
    store.update_run("r1", state="running")
    waiting = threading.Event()
    found: list = []

    def poll() -> None:
        waiting.set()
        found.extend(store.wait_events("r1", after=0, timeout=60))

    thread = threading.Thread(target=poll)
    thread.start()
    assert waiting.wait(10)
    store.add_event("r1", "round", "round 1")
    thread.join(timeout=30)
    assert not thread.is_alive() and [e.message for e in found] == ["round 1"]
