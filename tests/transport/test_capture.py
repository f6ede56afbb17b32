"""Encryption by default: a proxy recording every byte of a real run sees no model contents.

The coordinator runs in this process (so the test holds the exact model
state of every round), two workers are real ``meshkit node`` processes, and
every byte between them passes through a loopback TCP proxy written here.
With ``[mesh] encrypt = false`` the same capture shows the state's float32
values and key names, which proves the search can find them.
"""

from __future__ import annotations

import socket
import subprocess
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.configs import external_config
from tests.support.nodes import run_with_nodes, spawn_node
pytestmark = pytest.mark.slow

SECRET = b"capture-test-secret-0123456789ab"


class Proxy:
    """Forwards every connection to ``target`` and records every byte, both ways."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.data = bytearray()
        self.connections = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.address = "127.0.0.1:%d" % self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            server = socket.create_connection(self.target, timeout=10)
            self.connections += 1
            for src, dst in ((client, server), (server, client)):
                thread = threading.Thread(target=self._pump, args=(src, dst), daemon=True)
                thread.start()
                self._threads.append(thread)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        src.settimeout(None)
        while True:
            try:
                chunk = src.recv(1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                for sock in (src, dst):
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                return
            with self._lock:
                self.data += chunk
            try:
                dst.sendall(chunk)
            except OSError:
                return

    def close(self) -> bytes:
        self._stop.set()
        self._listener.close()
        for thread in self._threads:
            thread.join(10)
        with self._lock:
            return bytes(self.data)


def captured_run(tmp_path: Path, encrypt: bool) -> tuple[bytes, list[dict[str, np.ndarray]]]:
    """Every byte of a 2-round, 2-worker run, and the global state after each round."""
    config = external_config(tmp_path, workers=2, rounds=2, secret=SECRET,
                             mesh="" if encrypt else "encrypt = false")
    states: list[dict[str, np.ndarray]] = []
    proxies: list[Proxy] = []

    def on_round(report: Any, state: Any) -> None:
        states.append({k: np.array(v) for k, v in state.items() if isinstance(v, np.ndarray)})

    def start_nodes(address: str) -> list[subprocess.Popen]:
        proxies.append(Proxy(address))
        flags = [] if encrypt else ["--no-encrypt"]
        return [spawn_node(r, 3, proxies[0].address, tmp_path / "secret", *flags)
                for r in (1, 2)]

    try:
        report = run_with_nodes(config, start_nodes, on_round=on_round)
    finally:
        capture = proxies[0].close() if proxies else b""
    assert report.rounds_completed == 2
    assert proxies[0].connections == 2
    return capture, states


def leaked_windows(capture: bytes, state: dict[str, np.ndarray]) -> tuple[int, int]:
    """How many 16-byte pieces of the state's float bytes appear in ``capture``, of how many.

    Any run of 32 bytes of an array in the capture contains one of these
    aligned pieces, so none found means no run of 32 bytes or more leaked.
    Pieces with few distinct bytes (zeros, say) are skipped: they occur in
    headers and padding anyway.
    """
    found = checked = 0
    for array in state.values():
        if array.dtype.kind != "f":
            continue
        raw = array.tobytes()
        for start in range(0, len(raw) - 15, 16):
            piece = raw[start:start + 16]
            if len(set(piece)) >= 8:
                checked += 1
                found += piece in capture
    return found, checked


def test_an_encrypted_run_shows_no_model_values_and_no_key_names(tmp_path):
    capture, states = captured_run(tmp_path, encrypt=True)
    assert len(capture) > 100_000  # the model went back and forth
    names = [name.encode() for name in states[0]]
    assert names and all(len(name) >= 6 for name in names)
    assert [name for name in names if name in capture] == []
    for state in states:
        found, checked = leaked_windows(capture, state)
        assert checked > 100 and found == 0


def test_with_encrypt_false_the_same_capture_shows_both(tmp_path):
    capture, states = captured_run(tmp_path, encrypt=False)
    names = [name.encode() for name in states[0]]
    assert all(name in capture for name in names)
    # The global state after round 1 is what round 2 sends to every worker.
    found, checked = leaked_windows(capture, states[0])
    assert checked > 100 and found > checked // 2
