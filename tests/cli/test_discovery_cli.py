"""Discovery end to end from the CLI on 127.0.0.1: by broadcast and with ``--via``.

``meshkit coordinator`` starts the responder (``[mesh] discovery = true`` or
``--discovery``) and prints its UDP port; ``meshkit node --discover`` joins
through it, ``-v`` shows each step, SIGTERM stops a node still looking, and a
node that gives up says what it tried.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.support.configs import external_config, write_secret_file
pytestmark = pytest.mark.slow

SECRET = b"discovery-cli-secret-0123456789"


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "MESHKIT_SECRET"}


def _secret(tmp_path: Path) -> Path:
    return write_secret_file(tmp_path / "secret", SECRET)


def _config(tmp_path: Path, *, bind: str, discovery: bool) -> Path:
    return external_config(tmp_path, workers=2, rounds=1, secret=SECRET, bind=bind,
                           mesh=f"discovery = {'true' if discovery else 'false'}\n"
                                "discovery_port = 0")


class Lines:
    """Reads a pipe on a thread, so a test can wait for a line with a timeout."""

    def __init__(self, pipe) -> None:
        self.seen: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(pipe,), daemon=True).start()

    def _read(self, pipe) -> None:
        for line in pipe:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, text: str, timeout: float = 60) -> str:
        while True:
            line = self._queue.get(timeout=timeout)
            if line is None:
                raise AssertionError(f"{text!r} never appeared in {self.seen}")
            self.seen.append(line)
            if text in line:
                return line

    def rest(self, timeout: float = 60) -> str:
        while True:
            line = self._queue.get(timeout=timeout)
            if line is None:
                return "".join(self.seen)
            self.seen.append(line)


def _popen(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "meshkit", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())


def _run_discovered(tmp_path: Path, *, via: bool) -> None:
    config = _config(tmp_path, bind="127.0.0.1:0" if via else "0.0.0.0:0", discovery=via)
    # [mesh] discovery = true for the --via run, the --discovery flag for broadcast.
    coordinator = _popen("coordinator", str(config), *([] if via else ["--discovery"]))
    out = Lines(coordinator.stdout)
    nodes: list[subprocess.Popen] = []
    try:
        out.wait_for("coordinator listening on ")
        port = int(out.wait_for("discovery responder on UDP port").split()[-1])
        where = ["--via", "127.0.0.1"] if via else []
        for rank in (1, 2):
            nodes.append(_popen("node", "--rank", str(rank), "--world", "3", "--discover",
                                *where, "--disc-port", str(port), "--secret-file",
                                str(tmp_path / "secret"), "--timeout", "20", "-v"))
        text = out.rest(180)
        coordinator.wait(30)
        assert coordinator.returncode == 0, coordinator.stderr.read()
        assert "done: federated, 1 round(s)" in text
        for proc in nodes:
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
            how = f"unicast to 127.0.0.1:{port}" if via else f"broadcast to UDP port {port}"
            assert f"looking for the coordinator by {how}" in err
            assert "answered with its session; saying hello again" in err
            assert "rank 0 is at" in err
    finally:
        for proc in (coordinator, *nodes):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_nodes_join_a_coordinator_with_discovery_via_a_rendezvous_host(tmp_path):
    _run_discovered(tmp_path, via=True)


def _broadcast_reaches_this_host() -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
        rx.bind(("0.0.0.0", 0))
        rx.settimeout(1)
        tx.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        try:
            tx.sendto(b"ping", ("<broadcast>", rx.getsockname()[1]))
            return rx.recv(16) == b"ping"
        except OSError:
            return False


def test_nodes_join_a_coordinator_with_discovery_by_broadcast(tmp_path):
    if not _broadcast_reaches_this_host():
        pytest.skip("UDP broadcast does not reach this host's own sockets here")
    _run_discovered(tmp_path, via=False)


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_sigterm_stops_a_node_that_is_still_looking(tmp_path):
    port = _free_udp_port()
    proc = _popen("node", "--rank", "1", "--world", "3", "--discover", "--via", "127.0.0.1",
                  "--disc-port", str(port), "--secret-file", str(_secret(tmp_path)),
                  "--timeout", "600", "-v")
    err = Lines(proc.stderr)
    try:
        err.wait_for("looking for the coordinator")
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 143
    assert "stopped by SIGTERM while joining" in err.rest()


def test_a_node_that_finds_nothing_says_what_it_tried(tmp_path):
    port = _free_udp_port()
    proc = _popen("node", "--rank", "1", "--world", "3", "--discover", "--via", "127.0.0.1",
                  "--disc-port", str(port), "--secret-file", str(_secret(tmp_path)),
                  "--timeout", "1")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "Traceback" not in err
    assert f"hello(s) by unicast to 127.0.0.1:{port}" in err
    assert "tried for" in err and "nothing answered" in err
    assert "meshkit coordinator --discovery" in err
