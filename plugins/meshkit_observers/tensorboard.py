"""The ``tensorboard`` observer: one event file per run, every metric per round.

At ``meshkit_run_started`` it opens an event file (:mod:`event_file`) in
``<[run] out>/tensorboard/`` (or ``<dir>/<run name>/`` with ``dir`` set)
and writes the config as text (tag ``config``); after each round, every
finite numeric metric of the round's report as a scalar at ``step = round``
(plus ``round/examples`` and ``round/seconds``); at ``meshkit_run_finished``
it closes the file. ``tensorboard --logdir DIR`` shows them.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import meshkit

from meshkit_observers.event_file import EventFile
from meshkit_observers.options import TensorBoardOptions
from meshkit_observers.run_facts import config_text, round_scalars, run_name

__all__ = ["TensorBoardObserver"]

log = logging.getLogger(__name__)


class TensorBoardObserver:
    """Event files for the run that selected it."""

    def __init__(self, options: TensorBoardOptions) -> None:
        self.options = options
        self._lock = threading.Lock()
        self._file: EventFile | None = None

    def directory(self, config: Any) -> Path:
        """Where this run's event files go."""
        if self.options.dir:
            return Path(self.options.dir) / run_name(config)
        return Path(str(config.run.out)) / "tensorboard"

    @meshkit.hookimpl
    def meshkit_run_started(self, config: Any) -> None:
        with self._lock:
            self._close()
            self._file = EventFile(self.directory(config))
            self._file.text(0, "config", config_text(config))
            log.info("tensorboard: writing %s", self._file.path)

    @meshkit.hookimpl
    def meshkit_round_completed(self, report: Any) -> None:
        with self._lock:
            if self._file is None:
                raise RuntimeError("a round completed before meshkit_run_started opened the "
                                   "event file")
            self._file.scalars(int(report.round), round_scalars(report))

    @meshkit.hookimpl
    def meshkit_run_finished(self, report: Any) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
