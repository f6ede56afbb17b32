"""`meshkit node` helpers: the secret, and typed --board-option values."""

from __future__ import annotations

import pytest

from meshkit import ConfigError
from meshkit.cli import parse_board_options, read_secret
from meshkit_boards import LoopbackOptions


def test_the_secret_comes_from_the_file_first_then_the_environment(tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text("from-file\n")
    assert read_secret(str(secret_file), {"MESHKIT_SECRET": "from-env"}) == b"from-file"
    assert read_secret(None, {"MESHKIT_SECRET": "from-env"}) == b"from-env"


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
