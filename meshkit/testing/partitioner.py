"""The partitioner contract suite.

Subclass :class:`PartitionerContract` and point it at your component::

    class TestShards(PartitionerContract):
        component = "shards"
        options = {"per_client": 2}

What it checks, on a labelled set of rows: every row goes to exactly one
client and no client is empty (:func:`meshkit.partitioner.check_split`), the
parts are ascending int arrays, a split is a pure function of (labels,
clients, seed) -- the same seed gives the same parts, also from a fresh
instance, and the labels array is not modified -- and, when ``seeded`` is
true, another seed gives another split. A partitioner with ``per_node``
(each node's data is one client) is checked with one client. One with the
lazy form (``client_rows``) must give each client, computed alone by a
fresh instance, exactly its part of ``split``.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest

from meshkit.partitioner import check_split, is_lazy, is_per_node
from meshkit.testing.support import ContractBase

__all__ = ["PartitionerContract"]


class PartitionerContract(ContractBase):
    """Subclass, set ``component`` (and ``options``); see the module docstring."""

    kind: ClassVar[str] = "partitioner"
    #: Whether the split depends on the seed (false for ``contiguous``).
    seeded: ClassVar[bool] = True
    #: Rows and distinct labels of the labelled set the suite splits.
    rows: ClassVar[int] = 600
    labels: ClassVar[int] = 10
    #: Clients it is split into (one for a ``per_node`` partitioner).
    clients: ClassVar[int] = 5

    def _labels(self) -> np.ndarray:
        rng = np.random.default_rng(1234)
        labels = np.repeat(np.arange(self.labels), self.rows // self.labels)
        return rng.permutation(labels)

    def _clients(self, partitioner: object) -> int:
        return 1 if is_per_node(partitioner) else self.clients

    def test_every_row_goes_to_exactly_one_client(self) -> None:
        partitioner = self.make()
        labels = self._labels()
        clients = self._clients(partitioner)
        parts = partitioner.split(labels, clients, seed=0)
        check_split(parts, len(labels), clients, name=str(self.component))

    def test_parts_are_ascending_integer_rows(self) -> None:
        partitioner = self.make()
        for part in partitioner.split(self._labels(), self._clients(partitioner), seed=0):
            part = np.asarray(part)
            assert part.dtype.kind in "iu"
            assert np.all(np.diff(part) > 0)

    def test_a_split_is_a_pure_function_of_the_seed(self) -> None:
        labels = self._labels()
        before = labels.copy()
        first = self.make()
        clients = self._clients(first)
        a = first.split(labels, clients, seed=7)
        b = self.make().split(labels, clients, seed=7)
        assert len(a) == len(b)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(labels, before)

    def test_another_seed_gives_another_split(self) -> None:
        partitioner = self.make()
        clients = self._clients(partitioner)
        if not self.seeded or clients == 1:
            pytest.skip("does not apply: an unseeded or per-node partitioner has one split")
        labels = self._labels()
        a = partitioner.split(labels, clients, seed=0)
        b = partitioner.split(labels, clients, seed=1)
        assert any(not np.array_equal(x, y) for x, y in zip(a, b))

    def test_one_client_computed_alone_is_its_part_of_the_split(self) -> None:
        if not is_lazy(self.make()):
            pytest.skip("does not apply: no client_rows (the partitioner splits eagerly)")
        labels = self._labels()
        clients = self._clients(self.make())
        parts = self.make().split(labels, clients, seed=3)
        for client in reversed(range(clients)):  # the last first: no earlier client asked
            alone = self.make().client_rows(labels, clients, client, seed=3)
            np.testing.assert_array_equal(
                np.asarray(alone), parts[client],
                err_msg=f"client_rows(client={client}) differs from split()[{client}]")
