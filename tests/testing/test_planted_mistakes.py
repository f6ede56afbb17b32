"""The kit catches what a real run catches: 27 mistakes planted in three plugins (issue 33).

Each plugin in ``planted/`` is correct and passes its whole contract suite;
each mistake is that plugin with one thing wrong. A suite *catches* a mistake
when at least one of its checks fails on it. The suites' test methods are run
here directly, every parametrization expanded, with real ``tmp_path`` and
``monkeypatch`` fixtures (the observer suite plays a real two-round
``meshkit.run``).
"""

from __future__ import annotations

import itertools
import socket
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
from _pytest.outcomes import Skipped

from meshkit.testing import AggregatorContract, BoardContract, ObserverContract
from tests.testing.planted import clipped_mean, csv_log, dense_board


class ClippedMeanSuite(AggregatorContract):
    weighted = True
    build: Any = clipped_mean.ClippedMean

    def make(self, **overrides: Any) -> Any:
        return type(self).build()


class DenseBoardSuite(BoardContract):
    reference = staticmethod(dense_board.reference)
    build: Any = dense_board.DenseBoard

    def make(self, **overrides: Any) -> Any:
        return type(self).build()


class CsvLogSuite(ObserverContract):
    component = "csv-log"

    def check_recorded(self, out: Path, tmp_path: Path) -> None:
        lines = (out / "rounds.csv").read_text().splitlines()
        assert lines[0] == "round,loss" and [l.split(",")[0] for l in lines[1:]] == ["1", "2"]


def _calls(suite: Any):
    """Every (test name, kwargs) the suite's class would have pytest collect."""
    for name in sorted(n for n in dir(suite) if n.startswith("test_")):
        method = getattr(suite, name)
        axes = []
        for mark in reversed(getattr(method, "pytestmark", [])):
            if mark.name != "parametrize":
                continue
            names = [n.strip() for n in mark.args[0].split(",")]
            axes.append([dict(zip(names, v if len(names) > 1 else (v,)))
                         for v in mark.args[1]])
        for combo in itertools.product(*axes):
            yield name, {k: v for part in combo for k, v in part.items()}


def failures(suite: Any, tmp_root: Path) -> list[str]:
    """The suite's checks that fail on its component (skips are not failures)."""
    failed = []
    for index, (name, kwargs) in enumerate(_calls(suite)):
        method = getattr(suite, name)
        params = method.__code__.co_varnames[:method.__code__.co_argcount]
        with pytest.MonkeyPatch.context() as monkeypatch:
            fixtures = {"tmp_path": Path(tempfile.mkdtemp(prefix=f"{index}-", dir=tmp_root)),
                        "monkeypatch": monkeypatch}
            call = {**{k: v for k, v in fixtures.items() if k in params}, **kwargs}
            try:
                method(**call)
            except Skipped:
                continue
            except BaseException as exc:  # a failed check, or an error it provoked
                failed.append(f"{name}{kwargs or ''}: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}")
    return failed


@pytest.fixture
def listener():
    """A real TCP listener on 127.0.0.1, for the observer that connects from its factory."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(10)
    accepted = []

    def serve() -> None:
        try:
            conn, _ = server.accept()
            accepted.append(conn.recv(16))
            conn.close()
        except OSError:
            pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    address = server.getsockname()
    yield f"127.0.0.1:{address[1]}"
    if not accepted:  # wake the accept() no factory made
        socket.create_connection(address, timeout=5).close()
    thread.join(10)
    server.close()


def _suite(kind: str, cls: Any, listener: str) -> Any:
    if kind == "aggregator":
        return type("Planted", (ClippedMeanSuite,), {"build": cls})()
    if kind == "board":
        return type("Planted", (DenseBoardSuite,), {"build": cls})()
    return type("Planted", (CsvLogSuite,), {"plugins": [csv_log.plugin(cls)],
                                            "options": {"announce": listener}})()


def test_the_correct_plugins_pass_their_suites(tmp_path, listener):
    for kind, cls in (("aggregator", clipped_mean.ClippedMean),
                      ("board", dense_board.DenseBoard), ("observer", csv_log.CsvLog)):
        assert failures(_suite(kind, cls, listener), tmp_path) == [], kind


PLANTED = [(kind, what, cls) for kind, module in (("aggregator", clipped_mean),
                                                  ("board", dense_board),
                                                  ("observer", csv_log))
           for what, cls in module.MISTAKES.items()]


def test_there_are_27_planted_mistakes():
    assert len(PLANTED) == 27
    assert [k for k, _, _ in PLANTED].count("aggregator") == 11
    assert [k for k, _, _ in PLANTED].count("board") == 10
    assert [k for k, _, _ in PLANTED].count("observer") == 6


@pytest.mark.parametrize("kind, what, cls", PLANTED, ids=[f"{k}: {w}" for k, w, _ in PLANTED])
def test_the_kit_catches_the_planted_mistake(kind, what, cls, tmp_path, listener):
    assert failures(_suite(kind, cls, listener), tmp_path), (
        f"the {kind} suite passed a plugin with a planted mistake: {what}")
