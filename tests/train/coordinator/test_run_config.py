"""The run config: every value refused at load names the file, the table and the key."""

from __future__ import annotations

import textwrap

import pytest

from meshkit.cli import read_secret
from meshkit.config import load_config, parse_config
from meshkit.train._coordinator.plan import check
from meshkit.errors import ConfigError


def write(tmp_path, text: str, name: str = "c.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_a_negative_seed_is_refused_at_load_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"\[run\].*seed.*>= 0"):
        load_config(write(tmp_path, "[run]\nseed = -1\n"))


@pytest.mark.parametrize("value", ["inf", "9.3e9"])
@pytest.mark.parametrize("key", ["timeout", "join_timeout"])
def test_an_infinite_or_overflowing_timeout_is_refused_at_load(tmp_path, key, value):
    with pytest.raises(ConfigError, match=f"{key} must be a finite number of seconds, "
                                          f"at most 1e\\+09"):
        load_config(write(tmp_path, f"[mesh]\n{key} = {value}\n"))


MP = """
[strategy]
name = "model-parallel"
[[strategy.partitions]]
"""


@pytest.mark.parametrize("partition, message", [
    ('nodes = ["scale", "hidden", "output"]\nrank = 1.9',
     "[strategy] partitions[0].rank: expected an integer, got 1.9"),
    ('nodes = ["scale", "hidden", "output"]\nrank = true',
     "[strategy] partitions[0].rank: expected an integer, got True"),
    ('nodes = "scale"\nrank = 1',
     "[strategy] partitions[0].nodes: expected an array, got 'scale'"),
    ('nodes = ["scale", "hidden", "output"]\ntag = 5',
     "[strategy] partitions[0].tag: expected a string, got 5"),
    ('nodes = ["scale", "hidden", "output"]\nrank = 1\n[[strategy.boards]]\noptions = 5',
     "[strategy] boards[0].options: expected a table, got 5"),
])
def test_wrong_types_in_nested_tables_are_refused_not_coerced(tmp_path, partition, message):
    path = write(tmp_path, MP + partition + "\n")
    with pytest.raises(ConfigError) as err:
        check(path)
    assert str(err.value) == f"{path}: {message}"


def test_an_unknown_key_in_a_nested_table_reads_as_table_then_key(tmp_path):
    path = write(tmp_path, MP + 'nodes = ["scale", "hidden", "output"]\nrank = 1\n'
                 '[[strategy.boards]]\noptions = {stage_id = "scale"}\nbord = "x"\n')
    with pytest.raises(ConfigError, match=r"\[strategy\] boards\[0\]\.bord: unknown key"):
        check(path)


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path):
    path = tmp_path / "c.toml"
    path.write_bytes(b"\xff\xfe[run]\n")
    with pytest.raises(ConfigError, match="not valid TOML: TOML files are UTF-8"):
        load_config(path)


def test_the_coordinator_strips_meshkit_secret_like_meshkit_node_does():
    env = {"MESHKIT_SECRET": "s" * 32 + "\n"}
    config = parse_config({})
    assert config.secret(env) == read_secret(None, env) == b"s" * 32
