"""Over real processes: a node that joined by UDP discovery rejoins after a restart.

The discovery server kept rank -> (host, port, nonce) for the whole run and
refused the restarted node's new nonce as a duplicate rank; it now lets a
rank that has no link register again, as ``--peers`` lets it back in.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from meshkit import WireError
from meshkit.train import Runner, read_metrics
from meshkit.transport.discovery import DiscoveryServer, discover

from conftest import external_config

SECRET = b"discovery-rejoin-secret-0123456789"


@pytest.mark.parametrize("linked", [True, False], ids=["live", "gone"])
def test_a_new_hello_for_a_registered_rank_registers_only_when_the_rank_has_no_link(linked):
    links = {1: True}
    with DiscoveryServer(SECRET, 3, data_port=4000, host="127.0.0.1", port=0,
                         linked=lambda rank: links.get(rank, False)) as server:
        def hello(port: int):
            return discover(SECRET, rank=1, world=3, data_port=port, disc_port=server.port,
                            via="127.0.0.1", timeout=3.0)

        hello(4001)
        links[1] = linked
        if linked:  # someone else holding the secret cannot take a live rank
            with pytest.raises(WireError, match="duplicate rank"):
                hello(5001)
            assert server.table()[1] == "127.0.0.1:4001"
        else:  # the node restarted (its link is gone): registered again
            assert hello(5001).peers[0] == "127.0.0.1:4000"
            assert server.table()[1] == "127.0.0.1:5001"


def _node(rank: int, port: int, secret: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "MESHKIT_SECRET"}
    return subprocess.Popen(
        [sys.executable, "-m", "meshkit", "node", "--rank", str(rank), "--world", "3",
         "--discover", "--via", "127.0.0.1", "--disc-port", str(port), "--secret-file",
         str(secret), "--timeout", "20"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env)


def _wait_joined(proc: subprocess.Popen, timeout: float = 60) -> None:
    """Block until the node printed its caps line (it is connected), bounded."""
    seen = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            if line.startswith('{"event": "caps"') or '"event":"caps"' in line:
                seen.set()
        seen.set()  # ended without joining: the assertions below say why

    threading.Thread(target=read, daemon=True).start()
    assert seen.wait(timeout), "the restarted node never joined"


@pytest.mark.slow
def test_a_node_that_joined_by_discovery_rejoins_after_a_restart(tmp_path):
    config = external_config(tmp_path, workers=2, rounds=4, secret=SECRET,
                             mesh="discovery = true\ndiscovery_port = 0",
                             extra="clients = 2")
    nodes: dict[str, subprocess.Popen] = {}
    port: list[int] = []
    started = threading.Event()

    def progress(event) -> None:
        if event.kind == "discovery":
            port.append(int(event.message.split()[-1]))
            for rank in (1, 2):
                nodes[f"{rank}"] = _node(rank, port[0], tmp_path / "secret")
            started.set()

    def on_round(report, state) -> None:
        if report.round == 1:
            nodes["1"].kill()  # SIGKILL: no goodbye
            nodes["1"].wait(10)
            # The same command: same rank, a new process, a new discovery nonce.
            nodes["1 again"] = _node(1, port[0], tmp_path / "secret")
        if report.round == 2:
            _wait_joined(nodes["1 again"])  # connected: taken back before round 3

    try:
        report = Runner(str(config), progress=progress, on_round=on_round).run()
        assert started.is_set()
        again = nodes["1 again"]
        again.wait(60)
        err = again.stderr.read()
    finally:
        for proc in nodes.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert report.ok
    assert "duplicate rank" not in err
    assert again.returncode == 0, err  # its run finished: exit 0
    rows = read_metrics(tmp_path / "out")
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    # Round 2 went on without rank 1; a later round took the restarted node back.
    assert 1 in rows[0]["answered"] and rows[1]["dropped"] == [1]
    back = [r["round"] for r in rows if r["joined"] == [1]]
    assert back and all(1 in r["answered"] for r in rows if r["round"] > back[0])
