"""``meshkit relay``: the host relay command refuses what cannot work, with exit status 2."""

from __future__ import annotations

import threading

from click.testing import CliRunner

from meshkit.cli import main
from meshkit.node.config import NodeConfig

from tests.support.configs import external_config, write_config
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
        with coordinator._lock:
            coordinator._lock.wait_for(lambda: bool(coordinator._relays), 10)
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
