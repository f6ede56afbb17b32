"""`meshkit node` helpers: the secret, and typed --board-option values."""

from __future__ import annotations

from typing import Any

import pytest

from meshkit import ConfigError
from meshkit.cli import parse_board_options, read_secret
from meshkit_boards import LoopbackOptions


def test_the_secret_comes_from_the_file_first_then_the_environment(tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text("from-the-secret-file\n")
    secret_file.chmod(0o600)
    assert read_secret(str(secret_file), {"MESHKIT_SECRET": "from-the-environment"}) == \
        b"from-the-secret-file"
    assert read_secret(None, {"MESHKIT_SECRET": "from-the-environment"}) == \
        b"from-the-environment"


def test_no_secret_is_refused_with_what_to_do(tmp_path):
    with pytest.raises(ConfigError) as err:
        read_secret(None, {})
    assert str(err.value) == (
        "no shared secret: a node refuses to join a mesh unauthenticated. Pass "
        "--secret-file FILE (the same secret as the coordinator's secret_file) or set "
        "MESHKIT_SECRET")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="is empty; put the shared secret in it"):
        read_secret(str(empty), {"MESHKIT_SECRET": "ignored"})
    with pytest.raises(ConfigError, match="cannot read it"):
        read_secret(str(tmp_path / "missing"), {})


def test_board_options_are_typed_by_the_options_class():
    table = parse_board_options(
        ["stage_id=enc0", "input_elems=16", "output_elems=8", "scale=0.5",
         "function=affine", "weights=w.npy"], LoopbackOptions)
    assert table == {"stage_id": "enc0", "input_elems": 16, "output_elems": 8,
                     "scale": 0.5, "function": "affine", "weights": "w.npy"}


@pytest.mark.parametrize("pairs, message", [
    (["input_elems=16.5"], "[board] input_elems: expected an integer, got '16.5'"),
    (["scale=half"], "[board] scale: expected a number, got 'half'"),
    (["stage_id"], "--board-option 'stage_id': expected KEY=VALUE"),
    (["stage_id=a", "stage_id=b"], "--board-option stage_id: given twice"),
])
def test_bad_board_options_name_the_key(pairs, message):
    with pytest.raises(ConfigError) as err:
        parse_board_options(pairs, LoopbackOptions)
    assert str(err.value) == message


def _node(*extra: str) -> Any:
    from click.testing import CliRunner

    from meshkit.cli import main

    base = ["node", "--rank", "1", "--world", "2", "--peers", "127.0.0.1:9", "--board",
            "loopback", "--board-option", "input_elems=2", "--board-option", "output_elems=2"]
    return CliRunner().invoke(main, [*base, *extra], env={"MESHKIT_SECRET": "s" * 16})


@pytest.mark.parametrize("options, message", [
    (["stage_id=s", "dtype=float64"], "[board] dtype: invalid value: 'dtype' must be in"),
    (["stage_id="], "[board] stage_id: invalid value: Length of 'stage_id' must be >= 1"),
    (["stage_id=s", "function=r3_broken_board_module:run"],
     ("[board] function: cannot import module 'r3_broken_board_module': RuntimeError: "
      "boom at import")),
])
def test_bad_board_options_exit_2_with_a_message_not_a_traceback(tmp_path, monkeypatch,
                                                                  options, message):
    (tmp_path / "r3_broken_board_module.py").write_text(
        "raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    flags = [f for option in options for f in ("--board-option", option)]
    result = _node(*flags)
    assert result.exit_code == 2, result.exception
    assert message in result.output
