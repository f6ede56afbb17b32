"""A local worker that exits just as the capability handshake completes is quoted at once.

The runner waits for the workers' capabilities inside an :class:`ExitWatch`, which
polls the local worker processes. A worker may exit in the very moment the wait
completes: the watch then records the exit (and closes the group) after the wait
already returned, or has not polled yet. Either way the run must stop there,
quoting the worker's last words -- not start, and meet a closed group or a lost rank
later. The orderings are forced with events (no sleeps): the watch's polling
interval is far longer than any test, so it polls only when a test lets it.
"""

from __future__ import annotations

import threading
import types
from pathlib import Path
from typing import Any

import pytest

import meshkit.train._coordinator.runner as runner_module
from meshkit.errors import PeerLostError
from meshkit.train._coordinator.launch import ExitWatch, logs_dir
from meshkit.train._coordinator.runner import Runner


class Process:
    """A stand-in ``Popen``: running until :meth:`exit`; each ``poll`` is announced."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.polled = threading.Event()

    def exit(self, status: int) -> None:
        self.status = status

    def poll(self) -> int | None:
        self.polled.set()
        return self.status


def said(out: Path, rank: int, line: str) -> None:
    logs = logs_dir(out)
    logs.mkdir(parents=True, exist_ok=True)
    (logs / f"worker-{rank}.log").write_text(f"starting\nmeshkit: error: {line}\n")


def test_an_exit_the_watch_records_as_the_wait_returns_ends_the_wait_block(tmp_path):
    # The watch thread sees the exit and closes the group while the wait is returning
    # its (complete) result: the block must not complete as if nothing happened.
    proc = Process()
    closed = threading.Event()
    watch = ExitWatch({2: proc}, closed.set, interval=0.01)
    with pytest.raises(PeerLostError, match=r"local worker\(s\) \[2\] exited as the "
                                            r"capability handshake completed"):
        with watch:
            proc.exit(2)
            assert closed.wait(10)  # the watch acted; the "handshake" returns now anyway
    assert watch.exited == {2: 2}


def test_an_exit_the_watch_has_not_polled_yet_is_found_when_it_stops(tmp_path):
    proc = Process()
    watch = ExitWatch({3: proc}, lambda: pytest.fail("the watch never polls here"),
                      interval=3600)
    with pytest.raises(PeerLostError):
        with watch:
            proc.exit(1)  # and the wait returns before the watch's next look
    assert watch.exited == {3: 1}


def test_a_watch_whose_workers_all_live_lets_the_wait_block_complete():
    proc = Process()
    with ExitWatch({1: proc}, lambda: pytest.fail("nobody exited"), interval=3600) as watch:
        pass
    assert watch.exited == {} and proc.polled.is_set()


def test_the_runner_quotes_a_worker_that_exits_as_the_handshake_completes(tmp_path,
                                                                             monkeypatch):
    # The runner's join, with the handshake standing in: it returns every worker's
    # capabilities just as rank 2 exits (after the watch saw it and closed the group).
    said(tmp_path, 2, "[board] in_bitz: unknown key (did you mean 'in_bits'?)")
    proc, other = Process(), Process()
    closed = threading.Event()

    class Group:
        def close(self) -> None:
            closed.set()

    def collect_caps(group: Any, **_: Any) -> list[Any]:
        proc.exit(2)
        assert closed.wait(10)
        return [types.SimpleNamespace(rank=1), types.SimpleNamespace(rank=2)]

    monkeypatch.setattr(runner_module, "collect_caps", collect_caps)
    monkeypatch.setattr(runner_module.ExitWatch, "__init__", _fast(ExitWatch.__init__))
    runner = Runner(config="unused.toml", processes={1: other, 2: proc})  # type: ignore[arg-type]
    runner._out = str(tmp_path)
    plan = types.SimpleNamespace(config=types.SimpleNamespace(
        mesh=types.SimpleNamespace(min_workers=0, join_timeout=600.0)))
    with pytest.raises(PeerLostError) as info:
        runner._join(plan, Group(), pset=None)
    message = str(info.value)
    # It exited as the handshake completed, not before it: said so.
    assert message.startswith("local worker rank 2 exited (status 2) as the capability "
                              "handshake completed: [board] in_bitz: unknown key (did you "
                              "mean 'in_bits'?) (its log: "), message


def test_an_exit_that_ends_the_wait_is_described_as_before_the_handshake(tmp_path):
    said(tmp_path, 3, "no such task")
    proc = Process()
    closed = threading.Event()
    watch = ExitWatch({3: proc}, closed.set, interval=0.01)
    with pytest.raises(PeerLostError):
        with watch:
            proc.exit(1)
            assert closed.wait(10)  # the group closed: the "handshake" fails
            raise PeerLostError("the group was closed")
    assert watch.describe(tmp_path).startswith(
        "local worker rank 3 exited (status 1) before the capability handshake: no such task")


def _fast(init: Any) -> Any:
    def fast(self: Any, processes: Any, on_exit: Any, interval: float = 0.2) -> None:
        init(self, processes, on_exit, interval=0.01)
    return fast
