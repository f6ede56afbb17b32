"""``meshkit relay``: the host relay command refuses what cannot work, with exit status 2."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

import pytest
from click.testing import CliRunner

from meshkit.cli import main
from meshkit.node.config import NodeConfig
from meshkit.train import read_metrics

from tests.support.configs import external_config, write_config
from tests.support.nodes import finish, run_with_nodes, spawn_node

SECRET = "relay-command-secret-0123"


def invoke(*args: str, secret: str | None = SECRET):
    env = {"MESHKIT_SECRET": secret} if secret else {"MESHKIT_SECRET": ""}
    return CliRunner().invoke(main, ["relay", *args], env=env)


def test_the_relay_command_is_listed_and_documented():
    result = CliRunner().invoke(main, ["--help"])
    assert "relay" in result.output and "host relay" in result.output


def test_a_relay_without_a_secret_is_refused():
    result = invoke("--coordinator", "127.0.0.1:1", "--world", "3", "--ranks", "1", secret=None)
    assert result.exit_code == 2
    assert "no shared secret" in result.output


def test_bad_ranks_are_refused_naming_the_flag():
    result = invoke("--coordinator", "127.0.0.1:1", "--world", "3", "--ranks", "1,x")
    assert result.exit_code == 2
    assert "--ranks '1,x': 'x' is not a rank" in result.output
    result = invoke("--coordinator", "127.0.0.1:1", "--world", "3", "--ranks", "2-3")
    assert result.exit_code == 2 and "outside the workers 1..2" in result.output


def test_an_unreachable_coordinator_is_an_error_not_a_hang():
    result = invoke("--coordinator", "127.0.0.1:1", "--world", "3", "--ranks", "1,2",
                    "--timeout", "0.3")
    assert result.exit_code == 2
    assert "could not reach the coordinator at 127.0.0.1:1" in result.output


def test_the_relay_announces_where_its_ranks_dial_and_ends_with_the_coordinator():
    coordinator = NodeConfig(rank=0, world=2, topology="star", bind="127.0.0.1:0",
                             secret=SECRET.encode(), timeout=5.0).connect()
    # The coordinator goes once the relay joined: the relay then ends, exit 0.
    def close_when_relayed():
        with coordinator.links._lock:
            coordinator.links._lock.wait_for(lambda: bool(coordinator.links._relays), 10)
        coordinator.close()

    closer = threading.Thread(target=close_when_relayed, daemon=True)
    closer.start()
    result = invoke("--coordinator", coordinator.address, "--world", "2", "--ranks", "1",
                    "--name", "hostA")
    closer.join(10)
    assert result.exit_code == 0, result.output
    first = result.output.splitlines()[0]
    assert '"event": "relay"' in first and '"name": "hostA"' in first
    assert '"event": "report"' in result.output


def test_relays_beyond_the_workers_or_with_an_external_launch_are_refused(tmp_path):
    path = write_config(tmp_path / "c.toml", tmp_path / "out", workers=2, mesh="relays = 3")
    result = CliRunner().invoke(main, ["check", str(path)])
    assert result.exit_code == 2 and "relays = 3, but there are 2 workers" in result.output
    path = external_config(tmp_path, workers=2, rounds=4, secret=b"x" * 32, mesh="relays = 1")
    result = CliRunner().invoke(main, ["check", str(path)])
    assert result.exit_code == 2 and "start `meshkit relay`" in result.output


# -- real processes: a relay and the nodes behind it, against an in-process coordinator ----

RUN_SECRET = b"relay-command-run-secret-0123456789"


def spawn_relay(coordinator: str, ranks: str, world: int, secret_file,
                bind: str = "127.0.0.1:0") -> subprocess.Popen:
    """A ``meshkit relay`` process (stdout and stderr piped), without the user's MESHKIT_SECRET."""
    env = {k: v for k, v in os.environ.items() if k != "MESHKIT_SECRET"}
    return subprocess.Popen(
        [sys.executable, "-m", "meshkit", "relay", "--coordinator", coordinator, "--bind", bind,
         "--world", str(world), "--ranks", ranks, "--secret-file", str(secret_file),
         "--timeout", "20"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env)


def relay_address(relay: subprocess.Popen) -> str:
    """Where a started relay's ranks dial it (its first JSON line)."""
    line = relay.stdout.readline()
    assert line.startswith("{"), (line, finish(relay, 10)[1])
    return json.loads(line)["address"]


@pytest.mark.slow
def test_nodes_behind_a_relay_exit_0_when_the_coordinator_ends_the_run(tmp_path):
    # The coordinator's goodbye follows its `shutdown` jobs at once; the relay
    # must deliver the shutdowns before it closes the nodes' links, or each
    # node reports a lost coordinator (exit 2). Three nodes: three chances.
    config = external_config(tmp_path, workers=3, rounds=1, secret=RUN_SECRET,
                             extra="clients = 3")
    secret = tmp_path / "secret"

    def start(address):
        relay = spawn_relay(address, "1-3", 4, secret)
        where = relay_address(relay)
        return [relay, *(spawn_node(r, 4, where, secret) for r in (1, 2, 3))]

    # run_with_nodes asserts that the relay and every node exit 0.
    report = run_with_nodes(config, start)
    assert report.ok


@pytest.mark.slow
def test_a_relay_whose_bind_is_taken_fails_before_announcing_and_a_restarted_one_serves(
        tmp_path):
    config = external_config(tmp_path, workers=2, rounds=2, secret=RUN_SECRET,
                             extra="clients = 2")
    secret = tmp_path / "secret"
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    failed: dict[str, object] = {}

    def start(address):
        first = spawn_relay(address, "1,2", 3, secret, bind=f"127.0.0.1:{port}")
        failed["out"], failed["err"] = finish(first, 60)
        failed["status"] = first.returncode
        # Restarted on a free port: its ranks join and the run goes on.
        relay = spawn_relay(address, "1,2", 3, secret)
        where = relay_address(relay)
        return [relay, spawn_node(1, 3, where, secret), spawn_node(2, 3, where, secret)]

    try:
        report = run_with_nodes(config, start)
    finally:
        taken.close()
    assert failed["status"] == 2, failed["err"]
    assert f"127.0.0.1:{port}" in failed["err"] and "Traceback" not in failed["err"]
    assert report.ok and report.dropped == {}
    rows = read_metrics(tmp_path / "out")
    assert [r["dropped"] for r in rows] == [[], []]
    assert all(r["answered"] == [1, 2] for r in rows)
