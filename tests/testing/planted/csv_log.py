"""``csv-log``: an observer writing one CSV line per round; and six ways to get it wrong."""

from __future__ import annotations

import os
import socket
import types
from pathlib import Path
from typing import Any

import attrs

import meshkit


@attrs.frozen
class CsvLogOptions:
    #: The file, relative to the run's out directory.
    file: str = "rounds.csv"
    #: A host:port to announce runs to ("" for none).
    announce: str = ""


class CsvLog:
    """The correct observer: the file is opened when the run starts."""

    def __init__(self, options: CsvLogOptions) -> None:
        self.options = options
        self._fh: Any = None

    @meshkit.hookimpl
    def meshkit_run_started(self, config: Any) -> None:
        path = Path(str(config.run.out)) / self.options.file
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = path.open("w", encoding="utf-8")
        self._fh.write("round,loss\n")

    @meshkit.hookimpl
    def meshkit_round_completed(self, report: Any) -> None:
        self._fh.write(f"{report.round},{report.metrics.get('loss', '')}\n")
        self._fh.flush()

    @meshkit.hookimpl
    def meshkit_run_finished(self, report: Any) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class DeafRounds(CsvLog):
    def meshkit_round_completed(self, report: Any) -> None:  # the marker was lost
        super().meshkit_round_completed(report)


class OpensInTheFactory(CsvLog):
    def __init__(self, options: CsvLogOptions) -> None:
        super().__init__(options)
        self._fh = open(options.file, "w", encoding="utf-8")  # noqa: SIM115  (cwd!)

    @meshkit.hookimpl
    def meshkit_run_started(self, config: Any) -> None:
        self._fh.write("round,loss\n")


class ReadsAFieldThatIsNotThere(CsvLog):
    @meshkit.hookimpl
    def meshkit_round_completed(self, report: Any) -> None:
        self._fh.write(f"{report.round},{report.loss}\n")  # RoundReport has metrics, not loss


class MisnamedParameter(CsvLog):
    @meshkit.hookimpl
    def meshkit_round_completed(self, round_report: Any) -> None:  # type: ignore[override]
        self._fh.write(f"{round_report.round}\n")


class AnnouncesInTheFactory(CsvLog):
    def __init__(self, options: CsvLogOptions) -> None:
        super().__init__(options)
        host, port = options.announce.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as conn:
            conn.sendall(b"hello\n")


class MakesItsDirectoryInTheFactory(CsvLog):
    def __init__(self, options: CsvLogOptions) -> None:
        super().__init__(options)
        os.makedirs("csv-logs", exist_ok=True)


def plugin(cls: type = CsvLog) -> types.SimpleNamespace:
    """A plugin offering ``csv-log`` built by ``cls``."""
    def records() -> list[meshkit.Component]:
        return [meshkit.Component("csv-log", cls, CsvLogOptions)]
    return types.SimpleNamespace(__name__=f"csv-log-{cls.__name__}",
                                 meshkit_observers=meshkit.hookimpl(records))


MISTAKES: dict[str, Any] = {
    "deaf round hook (missing @meshkit.hookimpl)": DeafRounds,
    "file opened by the factory": OpensInTheFactory,
    "raising round hook": ReadsAFieldThatIsNotThere,
    "misnamed hook parameter": MisnamedParameter,
    "connection made by the factory": AnnouncesInTheFactory,
    "directory made by the factory": MakesItsDirectoryInTheFactory,
}
