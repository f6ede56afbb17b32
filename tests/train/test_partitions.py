"""Model-parallel partitions: put in graph order, and every way they can fail to tile it."""

from __future__ import annotations

import pytest

from meshkit.errors import ConfigError
from meshkit.train import Partition, order_partitions


def test_partitions_are_ordered_by_the_graph_not_by_declaration():
    declared = [Partition(("c", "d"), tag="gpu1"), Partition(("a", "b"), tag="gpu0")]
    stages = order_partitions(declared, ["a", "b", "c", "d"])
    assert [nodes for _, nodes in stages] == [["a", "b"], ["c", "d"]]


def test_a_node_in_two_partitions_is_refused():
    declared = [Partition(("a", "b"), rank=1), Partition(("b",), rank=2)]
    with pytest.raises(ConfigError, match="'b' is claimed by partitions 0 and 1"):
        order_partitions(declared, ["a", "b"])


def test_an_unclaimed_node_is_refused_by_name():
    with pytest.raises(ConfigError, match="no partition claims b"):
        order_partitions([Partition(("a",), rank=1)], ["a", "b"])


def test_interleaved_partitions_are_refused():
    declared = [Partition(("a", "c"), rank=1), Partition(("b",), rank=2)]
    with pytest.raises(ConfigError) as err:
        order_partitions(declared, ["a", "b", "c"])
    assert "interleaved" in str(err.value) and "'c'" in str(err.value)


def test_no_partitions_at_all_is_refused():
    with pytest.raises(ConfigError, match="nothing to say where any node runs"):
        order_partitions([], ["a"])


def test_a_partition_claiming_a_node_outside_the_graph_names_the_graph():
    with pytest.raises(ConfigError, match="not in this graph. Its nodes are: a, b"):
        order_partitions([Partition(("z",), rank=1)], ["a", "b"])
