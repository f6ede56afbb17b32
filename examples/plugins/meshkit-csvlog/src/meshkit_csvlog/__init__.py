"""meshkit-csvlog: an observer writing one CSV row per finished round.

It offers no component; it implements meshkit's event hooks:

* ``meshkit_run_started(config)`` opens ``<run.out>/rounds.csv`` (or the
  path in ``MESHKIT_CSVLOG``);
* ``meshkit_round_completed(report)`` appends a row: round, who answered,
  who was dropped, examples, seconds, then every metric;
* ``meshkit_run_finished(report)`` closes the file.

Observers must never break a run: a file that cannot be written is logged
and the run goes on.
"""

from __future__ import annotations

import csv
import logging
import os
import threading
from pathlib import Path
from typing import IO, Any

import meshkit

__all__ = ["CsvLogger", "observer"]
__version__ = "0.1.0"

log = logging.getLogger(__name__)

#: Columns every row has; the run's metrics follow, in the order first seen.
FIXED_COLUMNS = ("round", "rounds", "strategy", "answered", "dropped", "examples", "seconds")


def _out_dir(config: Any) -> str | None:
    """``[run] out`` from a Config (or a Plan wrapping one)."""
    for candidate in (config, getattr(config, "config", None)):
        run = getattr(candidate, "run", None)
        out = getattr(run, "out", None)
        if out:
            return str(out)
    return None


def _row(report: Any) -> dict[str, Any]:
    """The report as flat CSV cells (ranks joined with spaces)."""
    data = report.to_json() if hasattr(report, "to_json") else dict(vars(report))
    row = {}
    for key, value in data.items():
        if isinstance(value, (list, tuple)):
            value = " ".join(str(v) for v in value)
        row[key] = value
    return row


class CsvLogger:
    """The plugin object: one CSV file per run, one row per round."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        self._writer: csv.DictWriter | None = None
        self._columns: list[str] = []
        self.path: Path | None = None

    @meshkit.hookimpl
    def meshkit_run_started(self, config: Any) -> None:
        target = os.environ.get("MESHKIT_CSVLOG") or (
            os.path.join(_out_dir(config) or ".", "rounds.csv"))
        with self._lock:
            self._close()
            self.path = Path(target)
            self._columns = []

    @meshkit.hookimpl
    def meshkit_round_completed(self, report: Any) -> None:
        row = _row(report)
        with self._lock:
            try:
                self._write(row)
            except OSError as exc:
                log.warning("meshkit-csvlog: cannot write %s: %s", self.path, exc)

    @meshkit.hookimpl
    def meshkit_run_finished(self, report: Any) -> None:
        with self._lock:
            self._close()

    def _write(self, row: dict[str, Any]) -> None:
        if self.path is None:  # a round without run_started (e.g. a test harness)
            self.path = Path(os.environ.get("MESHKIT_CSVLOG") or "rounds.csv")
        if self._writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._columns = [c for c in FIXED_COLUMNS if c in row] + \
                [c for c in row if c not in FIXED_COLUMNS]
            self._file = open(self.path, "w", newline="", encoding="utf-8")
            self._writer = csv.DictWriter(self._file, self._columns, extrasaction="ignore")
            self._writer.writeheader()
        new = [c for c in row if c not in self._columns]
        if new:
            # A CSV has one header; a metric that appears mid-run is dropped, loudly.
            log.warning("meshkit-csvlog: round %s has new columns %s not in %s; dropped",
                        row.get("round"), new, self.path)
        self._writer.writerow(row)
        self._file.flush()

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file = None
        self._writer = None


#: The object the ``csvlog`` entry point names.
observer = CsvLogger()
