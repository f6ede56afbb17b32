"""Contributions pulled in pieces from real ``meshkit node`` processes (issue 39).

The coordinator runs here (so its transport can be watched), the workers
are real node processes over TCP on 127.0.0.1. Measured where the bytes
arrive: every message the coordinator reads during the run is at most one
piece (plus its header), and every frame at most one segment; a worker
killed half-way through handing over a contribution is dropped, its keys are
served again, and the model is the undisturbed run's, bit for bit.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshkit.train._rounds import pieces as pieces_module
from meshkit.wire import _channel
from tests.support.configs import write_secret_file
from tests.support.nodes import finish, spawn_node

pytestmark = pytest.mark.slow

SECRET = b"segfold-pieces-secret-0123456789abcdef"
PARAMS = 300_000        # float32: 1.2 MB, three arrays
PIECE = 196_608         # three segments of 64 KiB
SEGMENT = 65_536
#: A message's bytes besides its arrays' (the codec's header and JSON), at most.
OVERHEAD = 4096


def config(tmp_path: Path, name: str, *, piece: int = PIECE) -> Path:
    secret = write_secret_file(tmp_path / "secret", SECRET)
    path = tmp_path / f"{name}.toml"
    path.write_text(f"""
[run]
task = "meshkit_tasks.synthetic:SyntheticTask"
seed = 5
out = "{tmp_path / name}"

[mesh]
launch = "external"
workers = 2
bind = "127.0.0.1:0"
secret_file = "{secret}"
timeout = 30
join_timeout = 60
segment_bytes = {SEGMENT}
piece_bytes = {piece}

[strategy]
name = "federated"
rounds = 1
clients = 3

[task]
params = {PARAMS}
arrays = 3
rows = 96

[aggregator]
name = "fedavg"
""")
    return path


def run(path: Path, *, kill: tuple[int, int] | None = None) -> tuple[Any, list[int]]:
    """The run of ``path`` over two node processes; with ``kill = (key, piece)`` the worker
    asked for that piece is killed (SIGKILL) just before the request goes out."""
    from meshkit.train import Runner

    listening: list[str] = []
    ready = threading.Event()
    outcome: dict[str, Any] = {}
    procs: dict[int, Any] = {}
    killed: list[int] = []

    def progress(event: Any) -> None:
        if event.kind == "listening":
            listening.append(event.message.split()[3])
            ready.set()

    def drive() -> None:
        try:
            outcome["report"] = Runner(str(path), progress=progress).run()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            outcome["error"] = exc
        ready.set()

    original = pieces_module.PieceRound._take

    def take(self: Any, rank: int, key: int, piece: int) -> None:
        if kill is not None and (key, piece) == kill and not killed:
            killed.append(rank)
            procs[rank].kill()
            procs[rank].wait(30)
        original(self, rank, key, piece)

    pieces_module.PieceRound._take = take  # type: ignore[method-assign]
    try:
        coordinator = threading.Thread(target=drive, daemon=True)
        coordinator.start()
        assert ready.wait(60), "the coordinator never started listening"
        assert listening, outcome.get("error")
        for rank in (1, 2):
            procs[rank] = spawn_node(rank, 3, listening[0], path.parent / "secret",
                                     "--segment-bytes", str(SEGMENT))
        coordinator.join(300)
        assert not coordinator.is_alive(), "the run did not finish"
        for rank, proc in procs.items():
            _, err = finish(proc, 60)
            if rank not in killed:
                assert proc.returncode == 0, err
    finally:
        pieces_module.PieceRound._take = original  # type: ignore[method-assign]
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["report"], killed


def same(a: Any, b: Any) -> bool:
    return a.keys() == b.keys() and all(
        np.asarray(a[k]).tobytes() == np.asarray(b[k]).tobytes() for k in a)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The same run with the model inside one piece: contributions come whole."""
    tmp = tmp_path_factory.mktemp("whole")
    report, _ = run(config(tmp, "whole", piece=1 << 30))
    return report


def test_no_message_the_coordinator_reads_is_larger_than_a_piece(tmp_path, monkeypatch, whole):
    messages: list[int] = []
    frames: list[int] = []
    recv = _channel.Channel.recv

    def watched(self: Any, *args: Any, **kw: Any) -> Any:
        frame = recv(self, *args, **kw)
        messages.append(frame.nbytes)
        frames.append(self.largest_received)
        return frame

    monkeypatch.setattr(_channel.Channel, "recv", watched)
    report, _ = run(config(tmp_path, "pieces"))
    assert same(report.state, whole.state), "the same bits as whole contributions"
    assert messages and max(frames) <= SEGMENT
    # The workers' contributions (1.2 MB each) came in pieces; nothing larger arrived.
    assert max(messages) <= PIECE + OVERHEAD, max(messages)
    assert sum(n > PIECE // 2 for n in messages) >= 3 * (PARAMS * 4 // PIECE), "three contributions in pieces"
    # The test can fail: the whole run read each contribution as one message.
    assert PARAMS * 4 > PIECE + OVERHEAD


@pytest.mark.parametrize("kill", [(0, 3), (1, 3)], ids=["first", "after-part-summed"])
def test_a_worker_killed_mid_contribution_is_dropped_and_the_model_has_no_partial(
        tmp_path, whole, kill):
    report, killed = run(config(tmp_path, "killed"), kill=kill)
    assert killed, "a worker was killed mid-contribution"
    assert same(report.state, whole.state), "no partial contribution in the model"
    assert report.ok and killed[0] in report.dropped
    assert killed[0] in report.history[0].dropped, "dropped in the round it died in"
