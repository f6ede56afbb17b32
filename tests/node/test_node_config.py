"""NodeConfig: peers forms, and from_env parity with a clear error per bad value."""

from __future__ import annotations

import pytest

from meshkit import ConfigError, NodeConfig


def test_nothing_requires_an_environment():
    config = NodeConfig.from_env({})
    assert (config.rank, config.world, config.peers, config.topology) == (0, 1, (), "mesh")
    assert config.device == "auto" and config.heap_bytes is None and config.secret is None


def test_every_variable_is_read():
    config = NodeConfig.from_env({
        "RANK": "2", "WORLD": "4", "PEERS": "10.0.0.1:29500", "TOPOLOGY": "star",
        "HEAP_MB": "64", "DEVICE": "cpu", "MESHKIT_SECRET": "s3"})
    assert (config.rank, config.world, config.peers) == (2, 4, ("10.0.0.1:29500",))
    assert config.is_star and config.heap_bytes == 64 << 20 and config.device == "cpu"
    assert config.secret == b"s3"


def test_discovery_variables_and_dial_out():
    config = NodeConfig.from_env({
        "RANK": "1", "WORLD": "3", "DISCOVER": "1", "DISC_PORT": "31000",
        "DATA_PORT": "32000", "DISCOVER_HOST": "rendezvous.lan", "DIAL_OUT": "1"})
    assert config.discover and (config.disc_port, config.data_base) == (31000, 32000)
    assert config.via == "rendezvous.lan" and config.topology == "star"
    defaults = NodeConfig.from_env({"DISCOVER": "true"})
    assert (defaults.disc_port, defaults.data_base, defaults.via) == (29600, 29500, None)


def test_flags_override_the_environment():
    config = NodeConfig.from_env({"RANK": "1", "WORLD": "3"}, rank=2, device="cpu")
    assert config.rank == 2 and config.device == "cpu"


@pytest.mark.parametrize("env, message", [
    ({"RANK": "one"}, "RANK must be an integer, got 'one'"),
    ({"RANK": "-1", "WORLD": "2"}, "RANK must be >= 0, got -1"),
    ({"WORLD": "2.5"}, "WORLD must be an integer, got '2.5'"),
    ({"WORLD": "0"}, "WORLD must be >= 1, got 0"),
    ({"RANK": "3", "WORLD": "3"},
     "rank 3 is out of range for a world of 3 (ranks are 0..2; the coordinator is rank 0)"),
    ({"HEAP_MB": "lots"}, "HEAP_MB must be an integer, got 'lots'"),
    ({"HEAP_MB": "0"}, "HEAP_MB must be >= 1, got 0"),
    ({"DISCOVER": "maybe"}, "DISCOVER must be 0 or 1 (or true/false), got 'maybe'"),
    ({"DISCOVER": "1", "DISC_PORT": "70000"}, "DISC_PORT must be 1..65535, got 70000"),
    ({"DISCOVER": "1", "DATA_PORT": "http"}, "DATA_PORT must be an integer, got 'http'"),
    ({"TOPOLOGY": "ring"}, "TOPOLOGY must be 'star' or 'mesh', got 'ring'"),
    ({"DIAL_OUT": "sometimes"}, "DIAL_OUT must be 0 or 1 (or true/false), got 'sometimes'"),
])
def test_a_bad_environment_value_is_a_clear_error(env, message):
    with pytest.raises(ConfigError) as err:
        NodeConfig.from_env(env)
    assert str(err.value) == message


PEERS_ERROR = ("peers: got 2 address(es); expected 4 (one per rank, for a mesh) or 1 "
               "(the coordinator, for a star)")


def test_a_peers_list_of_the_wrong_length_states_both_forms():
    with pytest.raises(ConfigError) as err:
        NodeConfig(rank=1, world=4, peers=["a:1", "b:2"])
    assert str(err.value) == PEERS_ERROR
    with pytest.raises(ConfigError) as err:
        NodeConfig.from_env({"RANK": "1", "WORLD": "4", "PEERS": "a:1, b:2"})
    assert str(err.value) == PEERS_ERROR


def test_both_peers_forms_are_accepted():
    star = NodeConfig(rank=1, world=4, peers="coord:29500")
    assert star.is_star and star.peers == ("coord:29500",)
    mesh = NodeConfig(rank=1, world=3, peers=["a:1", "b:2", "c:3"])
    assert not mesh.is_star and len(mesh.peers) == 3


def test_discovery_data_ports_past_65535_are_refused_naming_the_setting():
    # Rank r listens on data_base + r: rank 1 of 2 would need port 65536. Before
    # this was refused, discovery dropped the datagram and the node timed out.
    with pytest.raises(ConfigError) as err:
        NodeConfig(rank=1, world=2, discover=True, data_base=65535, secret=b"s")
    assert str(err.value) == (
        "data_base 65535: with discovery, rank r listens on data_base + r, so a world of "
        "2 needs ports up to 65536; choose a data_base of at most 65534")
    with pytest.raises(ConfigError, match="needs ports up to 65536"):
        NodeConfig.from_env({"RANK": "1", "WORLD": "2", "DISCOVER": "1", "DATA_PORT": "65535"})
    assert NodeConfig(rank=1, world=2, discover=True, data_base=65534).data_base == 65534
    # Without discovery the data ports are not used.
    assert NodeConfig(rank=1, world=2, peers=["h:1"], data_base=65535).data_base == 65535
