"""``[serve]``: every mistake names the file, the table and the key, and exits 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshkit.errors import ConfigError
from meshkit.service import parse_serve_config
from tests.support.cli import run_cli


@pytest.mark.parametrize("table, message", [
    ({"serve": {"state_dir": "s", "colour": 1}}, r"\[serve\] colour: unknown key"),
    ({"serve": {"state_dir": "s", "bind": "nowhere"}}, r"\[serve\] bind: .*host:port"),
    ({"serve": {"state_dir": "s", "bind": "127.0.0.1:70000"}}, r"\[serve\] bind: .*port in 0..65535"),
    ({"serve": {"state_dir": ""}}, r"\[serve\] state_dir: .*must name a directory"),
    ({"serve": {}}, r"\[serve\].*state_dir"),
    ({}, r"no \[serve\] table"),
    ({"serve": {"state_dir": "s"}, "run": {}}, r"\[run\]: unknown table"),
    ({"serve": {"state_dir": "s", "tls_cert": "c.pem"}}, r"\[serve\] tls_key: .*go together"),
    ({"serve": {"state_dir": "s", "control": "0.0.0.0:8080"}},
     r"\[serve\] control: '0.0.0.0:8080' is not loopback.*tls_cert"),
])
def test_a_bad_serve_table_names_file_table_and_key(table: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        parse_serve_config(table, path="serve.toml")
    assert str(info.value).startswith("serve.toml")


def test_control_beyond_loopback_is_allowed_with_tls_and_paths_resolve_beside_the_file(
        tmp_path: Path) -> None:
    config = parse_serve_config({"serve": {"state_dir": "state", "control": "0.0.0.0:0",
                                           "tls_cert": "c.pem", "tls_key": "k.pem"}},
                                path=str(tmp_path / "serve.toml"))
    assert config.state_dir == str(tmp_path / "state")
    assert config.tls_cert == str(tmp_path / "c.pem")


def test_meshkit_serve_with_a_bad_table_exits_2_without_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "serve.toml"
    path.write_text('[serve]\nstate_dir = "s"\nbnd = "127.0.0.1:0"\n')
    result = run_cli("serve", str(path), cwd=str(tmp_path))
    assert result.returncode == 2
    assert f"{path}: [serve] bnd: unknown key" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_client_without_a_service_or_token_is_told_what_to_pass(tmp_path: Path) -> None:
    result = run_cli("ls", cwd=str(tmp_path))
    assert result.returncode == 2 and "no service: pass --service" in result.stderr
    result = run_cli("ls", "--service", "127.0.0.1:9", cwd=str(tmp_path))
    assert result.returncode == 2 and "no token: pass --token-file" in result.stderr
