"""The [transport] table reaches every rank: the coordinator and each spawned node."""

from __future__ import annotations

import attrs
import pytest

from meshkit.errors import ConfigError
from meshkit.node.config import NodeConfig
from meshkit.train import Runner
from meshkit_tcp.testing import inproc_configs

from tests.support.cli import run_cli
from tests.support.configs import write_config
def test_node_config_connects_with_its_transport_options():
    config = NodeConfig(rank=0, world=2, topology="star", bind="127.0.0.1:0",
                        secret=b"test-secret-0123456", timeout=5,
                        transport_options={"max_frame_bytes": 1 << 20})
    with config.connect() as group:
        assert group.links.max_frame == 1 << 20


def test_an_unknown_transport_option_names_the_table_and_key():
    configs = [attrs.evolve(c, transport_options={"bf16_wir": True}) for c in inproc_configs(2)]
    with pytest.raises(ConfigError, match=r"\[transport\] bf16_wir: unknown key"):
        configs[1].connect()


@pytest.mark.parametrize("option, says", [
    ("max_frame_bytes=lots", "[transport] max_frame_bytes: expected an integer, got 'lots'"),
    ("bf16_wire=true", "[transport] bf16_wire: removed (issue 21)"),
])
def test_meshkit_node_refuses_a_bad_transport_option_before_connecting(tmp_path, option, says):
    secret = tmp_path / "secret"
    secret.write_text("x" * 32)
    secret.chmod(0o600)
    result = run_cli("node", "--rank", "1", "--world", "2", "--peers", "127.0.0.1:9",
                     "--secret-file", str(secret), "--transport-option", option)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert says in result.stderr


@pytest.mark.slow
def test_a_local_run_hands_the_transport_table_to_every_worker(tmp_path):
    out = tmp_path / "out"
    config = write_config(tmp_path / "c.toml", out, workers=2, rounds=2)
    config.write_text(config.read_text() + "\n[transport]\nmax_frame_bytes = 536870912\n")
    procs = {}
    report = Runner(str(config), on_workers=procs.update).run()
    assert report.ok and report.rounds_completed == 2
    for proc in procs.values():
        args = list(proc.args)
        assert args[args.index("--transport-option") + 1] == "max_frame_bytes=536870912"


def test_bf16_wire_in_a_run_config_is_refused_as_removed_saying_why(tmp_path):
    config = write_config(tmp_path / "c.toml", tmp_path / "out", workers=2, rounds=1)
    config.write_text(config.read_text() + "\n[transport]\nbf16_wire = true\n")
    for command in ("check", "run"):
        result = run_cli(command, str(config))
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert "[transport] bf16_wire: removed (issue 21)" in result.stderr
        assert "star reduce service" in result.stderr and "Remove the key" in result.stderr
    assert not (tmp_path / "out").exists()
