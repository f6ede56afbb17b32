"""``meshkit node --roster``: a signed secure round's roster needs the node's own key, and a readable file."""

from __future__ import annotations

from tests.support.cli import run_cli


def _secret(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    secret.chmod(0o600)
    return secret


def test_a_roster_without_a_key_is_refused_saying_what_is_needed(tmp_path):
    roster = tmp_path / "roster"
    roster.write_text("")
    result = run_cli("node", "--rank", "1", "--world", "2", "--peers", "127.0.0.1:9",
                     "--secret-file", str(_secret(tmp_path)), "--roster", str(roster))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--roster needs --key FILE" in result.stderr and "meshkit keygen" in result.stderr


def test_a_malformed_roster_is_refused_naming_the_line(tmp_path):
    assert run_cli("keygen", str(tmp_path / "k")).returncode == 0
    roster = tmp_path / "roster"
    roster.write_text("not a key line\n")
    result = run_cli("node", "--rank", "1", "--world", "2", "--peers", "127.0.0.1:9",
                     "--secret-file", str(_secret(tmp_path)), "--key", str(tmp_path / "k"),
                     "--roster", str(roster))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"--roster: {roster}:1" in result.stderr
