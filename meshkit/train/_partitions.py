"""Model-parallel partitions: which graph nodes a stage owns, and which worker runs it.

A stage's output is the next stage's input, so the partitions must tile the
task's graph exactly: :func:`order_partitions` puts them in graph order and
refuses anything else. Where a partition runs is decided by
:meth:`meshkit.train.StrategyContext.worker_for` from the
:class:`WorkerIdentity` each worker advertised.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import attrs

from meshkit.errors import ConfigError

__all__ = ["Partition", "WorkerIdentity", "order_partitions"]


def _names(nodes: Iterable[str]) -> tuple[str, ...]:
    return tuple(nodes)


@attrs.frozen
class Partition:
    """A stage: the graph nodes it owns and the worker it is pinned to.

    ``rank`` pins it to a worker by rank (its id), ``tag`` to the worker
    advertising that tag; exactly one of the two.
    """

    nodes: tuple[str, ...] = attrs.field(converter=_names)
    rank: int | None = None
    tag: str | None = None

    def target(self) -> str:
        return f"rank {self.rank}" if self.rank is not None else f"tag {self.tag!r}"


@attrs.frozen
class WorkerIdentity:
    """How a partition can name a worker: its rank and the tags it advertised."""

    rank: int
    tags: tuple[str, ...] = ()


def order_partitions(partitions: Sequence[Partition], node_ids: Sequence[str]
                     ) -> list[tuple[Partition, list[str]]]:
    """Put partitions in graph order and check they tile the graph.

    A stage's output is the next stage's input, which only means something
    when every node runs exactly once: a node claimed twice would run twice
    with the second activation overwriting the first, an unclaimed node has
    no worker (model parallelism has no default target), and interleaved
    stages would need the activation to cross back.
    """
    if not partitions:
        raise ConfigError(
            "model-parallel with no partitions: there is nothing to say where any node "
            f"runs. Add [[strategy.partitions]] tables covering {', '.join(node_ids)}")
    position = {node: i for i, node in enumerate(node_ids)}
    claimed: dict[str, int] = {}
    stages: list[tuple[Partition, list[int]]] = []
    for index, partition in enumerate(partitions):
        if not partition.nodes:
            raise ConfigError(f"partition {index} ({partition.target()}) claims no nodes")
        positions = []
        for node in partition.nodes:
            if node not in position:
                raise ConfigError(
                    f"partition {index} claims {node!r}, which is not in this graph. Its "
                    f"nodes are: {', '.join(node_ids)}")
            if node in claimed:
                raise ConfigError(
                    f"{node!r} is claimed by partitions {claimed[node]} and {index}. A node "
                    f"runs in one place")
            claimed[node] = index
            positions.append(position[node])
        stages.append((partition, sorted(positions)))
    unclaimed = [n for n in node_ids if n not in claimed]
    if unclaimed:
        raise ConfigError(
            f"no partition claims {', '.join(unclaimed)}. Every node needs a worker; model "
            f"parallelism has no default target")
    stages.sort(key=lambda item: item[1][0])
    expected = 0
    for partition, positions in stages:
        for pos in positions:
            if pos != expected:
                index = partitions.index(partition)
                raise ConfigError(
                    f"partition {index} is interleaved with another: it owns "
                    f"{node_ids[pos]!r} but not {node_ids[expected]!r}, which runs before "
                    f"it. A stage has to own a contiguous run of the graph")
            expected += 1
    return [(p, [node_ids[i] for i in positions]) for p, positions in stages]
