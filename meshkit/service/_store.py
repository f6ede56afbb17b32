"""The service's memory: one SQLite database, ``STATE_DIR/service.db``.

Everything the service must still know after a ``kill -9`` lives here and
nowhere else: runs (their config as submitted, state, result), each run's
events (what ``meshkit logs`` prints and the status page plots), the node
registry and the addresses the service bound (kept so nodes rejoin the
address they know). Checkpoints stay in each run's directory, as for
``meshkit run``.

The schema is versioned with ``PRAGMA user_version``: :data:`MIGRATIONS` is
the list of steps from an empty file, each run once in a transaction, so a
database written by an older meshkit is brought up to date on open and one
written by a newer meshkit is refused (rather than misread). A connection is
used by one thread at a time (a lock), and every write is committed before
the call returns: the database is the truth after a crash.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import attrs

from meshkit.errors import ConfigError

__all__ = ["Store", "RunRecord", "EventRecord", "NodeRecord", "MIGRATIONS", "SCHEMA_VERSION",
           "RUN_STATES", "UNFINISHED"]

#: Each step takes the schema from version i to i + 1.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    # 1: runs, their events, the node registry, the service's own facts.
    ("""CREATE TABLE runs (
            id TEXT PRIMARY KEY, seq INTEGER NOT NULL UNIQUE, name TEXT NOT NULL,
            config TEXT NOT NULL, authorized TEXT, state TEXT NOT NULL,
            submitted REAL NOT NULL, started REAL, finished REAL,
            rounds INTEGER NOT NULL, workers INTEGER NOT NULL,
            rounds_completed INTEGER NOT NULL DEFAULT 0, error TEXT, result TEXT)""",
     """CREATE TABLE events (
            run TEXT NOT NULL REFERENCES runs(id), seq INTEGER NOT NULL, at REAL NOT NULL,
            kind TEXT NOT NULL, message TEXT NOT NULL, data TEXT,
            PRIMARY KEY (run, seq))""",
     """CREATE TABLE nodes (
            id TEXT PRIMARY KEY, public TEXT, caps TEXT, address TEXT,
            first_seen REAL NOT NULL, last_seen REAL NOT NULL, connected INTEGER NOT NULL)""",
     "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"),
    # 2: stop requests survive a restart; nodes keep a count of what they served.
    ("ALTER TABLE runs ADD COLUMN stop_requested INTEGER NOT NULL DEFAULT 0",
     "ALTER TABLE nodes ADD COLUMN runs_served INTEGER NOT NULL DEFAULT 0",
     "ALTER TABLE nodes ADD COLUMN busy_run TEXT"),
)
SCHEMA_VERSION = len(MIGRATIONS)

#: A run's states; the first three are unfinished (a restart continues them).
RUN_STATES = ("queued", "running", "stopping", "finished", "failed", "stopped")
UNFINISHED = ("queued", "running", "stopping")


@attrs.frozen
class RunRecord:
    id: str
    seq: int
    name: str
    config: str
    authorized: str | None
    state: str
    submitted: float
    started: float | None
    finished: float | None
    rounds: int
    workers: int
    rounds_completed: int
    error: str | None
    result: dict[str, Any] | None
    stop_requested: bool

    def to_json(self, *, config: bool = False) -> dict[str, Any]:
        data = attrs.asdict(self)
        data.pop("authorized")
        if not config:
            data.pop("config")
        return data


@attrs.frozen
class EventRecord:
    run: str
    seq: int
    at: float
    kind: str
    message: str
    data: dict[str, Any] | None

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen
class NodeRecord:
    id: str
    public: str | None
    caps: dict[str, Any] | None
    address: str | None
    first_seen: float
    last_seen: float
    connected: bool
    runs_served: int
    busy_run: str | None

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


_RUN_COLUMNS = ("id, seq, name, config, authorized, state, submitted, started, finished, "
                "rounds, workers, rounds_completed, error, result, stop_requested")
_NODE_COLUMNS = ("id, public, caps, address, first_seen, last_seen, connected, runs_served, "
                 "busy_run")


def _json(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _run(row: Sequence[Any]) -> RunRecord:
    values = list(row)
    values[13] = _json(values[13])
    values[14] = bool(values[14])
    return RunRecord(*values)


def _node(row: Sequence[Any]) -> NodeRecord:
    values = list(row)
    values[2] = _json(values[2])
    values[6] = bool(values[6])
    return NodeRecord(*values)


def migrate(db: sqlite3.Connection, *, upto: int = SCHEMA_VERSION, where: str = "") -> int:
    """Bring ``db`` to schema ``upto``; returns the version it had."""
    (found,) = db.execute("PRAGMA user_version").fetchone()
    if found > SCHEMA_VERSION:
        raise ConfigError(
            f"{where}: schema version {found} is newer than this meshkit's "
            f"({SCHEMA_VERSION}); upgrade meshkit, or point state_dir elsewhere")
    for version in range(found, upto):
        with db:  # one transaction per step: a crash leaves the previous version whole
            for statement in MIGRATIONS[version]:
                db.execute(statement)
            db.execute(f"PRAGMA user_version = {version + 1}")
    return int(found)


class Store:
    """The service's SQLite database (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = FULL")
        except sqlite3.DatabaseError as exc:
            raise ConfigError(f"{self.path}: not a meshkit service database ({exc}); point "
                              f"state_dir at another directory") from None
        except sqlite3.Error as exc:
            raise ConfigError(f"{self.path}: cannot open the service database: {exc}") from None
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._generation = 0
        try:
            self.migrated_from = migrate(self._db, where=str(self.path))
        except sqlite3.DatabaseError as exc:
            raise ConfigError(f"{self.path}: not a meshkit service database ({exc}); point "
                              f"state_dir at another directory") from None

    def _notify(self) -> None:
        # Called with the lock held, after a change.
        self._generation += 1
        self._changed.notify_all()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- meta ---------------------------------------------------------------------

    def get_meta(self, key: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                             (key, value))

    # -- runs ---------------------------------------------------------------------

    def add_run(self, *, name: str, config: str, authorized: str | None, rounds: int,
                workers: int) -> RunRecord:
        with self._lock, self._db:
            (seq,) = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM runs").fetchone()
            run_id = f"r{seq}"
            self._db.execute(
                "INSERT INTO runs (id, seq, name, config, authorized, state, submitted, rounds,"
                " workers) VALUES (?, ?, ?, ?, ?, 'queued', ?, ?, ?)",
                (run_id, seq, name, config, authorized, time.time(), rounds, workers))
            self._notify()
        record = self.run(run_id)
        assert record is not None
        return record

    def run(self, run_id: str) -> RunRecord | None:
        with self._lock:
            row = self._db.execute(f"SELECT {_RUN_COLUMNS} FROM runs WHERE id = ?",
                                   (run_id,)).fetchone()
        return None if row is None else _run(row)

    def runs(self, states: Sequence[str] = ()) -> list[RunRecord]:
        query = f"SELECT {_RUN_COLUMNS} FROM runs"
        if states:
            query += f" WHERE state IN ({', '.join('?' * len(states))})"
        with self._lock:
            rows = self._db.execute(query + " ORDER BY seq", tuple(states)).fetchall()
        return [_run(row) for row in rows]

    def update_run(self, run_id: str, **fields: Any) -> None:
        allowed = {"state", "started", "finished", "rounds_completed", "error", "result",
                   "stop_requested"}
        unknown = set(fields) - allowed
        if unknown:
            raise ValueError(f"not a run column: {sorted(unknown)}")
        if "result" in fields and fields["result"] is not None:
            fields["result"] = json.dumps(fields["result"])
        assignments = ", ".join(f"{key} = ?" for key in fields)
        with self._lock, self._db:
            self._db.execute(f"UPDATE runs SET {assignments} WHERE id = ?",
                             (*fields.values(), run_id))
            self._notify()

    # -- events -------------------------------------------------------------------

    def add_event(self, run_id: str, kind: str, message: str,
                  data: dict[str, Any] | None = None) -> int:
        with self._lock, self._db:
            (seq,) = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM events WHERE run = ?",
                                      (run_id,)).fetchone()
            self._db.execute("INSERT INTO events (run, seq, at, kind, message, data) "
                             "VALUES (?, ?, ?, ?, ?, ?)",
                             (run_id, seq, time.time(), kind, message,
                              None if data is None else json.dumps(data)))
            self._notify()
        return int(seq)

    def events(self, run_id: str, *, after: int = 0, kinds: Sequence[str] = (),
               limit: int = 10_000) -> list[EventRecord]:
        query = "SELECT run, seq, at, kind, message, data FROM events WHERE run = ? AND seq > ?"
        args: list[Any] = [run_id, after]
        if kinds:
            query += f" AND kind IN ({', '.join('?' * len(kinds))})"
            args.extend(kinds)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY seq LIMIT ?", (*args, limit)).fetchall()
        return [EventRecord(r[0], r[1], r[2], r[3], r[4], _json(r[5])) for r in rows]

    def wait_events(self, run_id: str, *, after: int, timeout: float) -> list[EventRecord]:
        """Events after ``after``, waiting up to ``timeout`` s for one (``logs --follow``)."""
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            with self._lock:
                seen = self._generation
            found = self.events(run_id, after=after)
            record = self.run(run_id)
            remaining = deadline - time.monotonic()
            if found or remaining <= 0 or record is None or record.state not in UNFINISHED:
                return found
            with self._changed:
                # Only if nothing changed since the reads above (else read again).
                if self._generation == seen:
                    self._changed.wait(remaining)

    # -- nodes --------------------------------------------------------------------

    def node_seen(self, node_id: str, *, public: str | None, caps: dict[str, Any],
                  address: str) -> None:
        now = time.time()
        with self._lock, self._db:
            self._db.execute(
                "INSERT INTO nodes (id, public, caps, address, first_seen, last_seen, connected)"
                " VALUES (?, ?, ?, ?, ?, ?, 1) ON CONFLICT(id) DO UPDATE SET"
                " caps = excluded.caps, address = excluded.address,"
                " last_seen = excluded.last_seen, connected = 1",
                (node_id, public, json.dumps(caps), address, now, now))
            self._notify()

    def update_node(self, node_id: str, *, connected: bool | None = None,
                    busy_run: str | None | bool = False, served: bool = False) -> None:
        sets = ["last_seen = ?"]
        args: list[Any] = [time.time()]
        if connected is not None:
            sets.append("connected = ?")
            args.append(int(connected))
        if busy_run is not False:
            sets.append("busy_run = ?")
            args.append(busy_run)
        if served:
            sets.append("runs_served = runs_served + 1")
        with self._lock, self._db:
            self._db.execute(f"UPDATE nodes SET {', '.join(sets)} WHERE id = ?",
                             (*args, node_id))
            self._notify()

    def disconnect_all(self) -> None:
        """At start-up: whatever the last process knew of live links died with it."""
        with self._lock, self._db:
            self._db.execute("UPDATE nodes SET connected = 0, busy_run = NULL")

    def nodes(self) -> list[NodeRecord]:
        with self._lock:
            rows = self._db.execute(f"SELECT {_NODE_COLUMNS} FROM nodes ORDER BY id").fetchall()
        return [_node(row) for row in rows]
