"""The built-in splits, one class each; every one a pure function of (labels, clients, seed).

Each draws from its own seeded stream (the run seed and a constant naming
the partitioner), so a split does not change when something else in the
run draws random numbers, and every node computes the same split from its
own copy of the data.

Each also offers the lazy form (:mod:`meshkit.partitioner`):
``client_rows(labels, clients, client, seed=...)`` is ``split(...)[client]``
bit for bit, computed from what the split draws once per node -- for
``iid`` one permutation of the rows, for ``dirichlet`` each label's shuffled
rows and its cut points (one per client and label), for ``pathological``
the deck and each label's holders -- never a list of every client's rows.
That draw is cached for the last labels array asked about (by identity: a
worker's training labels are one array for the whole run).
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from meshkit import ConfigError
from meshkit.train import shard_bounds

from meshkit_partitioners.options import DirichletOptions, NoOptions, PathologicalOptions

__all__ = ["Contiguous", "Iid", "Dirichlet", "Pathological", "Local"]


def _rng(seed: int, name: str, *extra: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), *name.encode(), *extra])


def _piece(n: int, parts: int, i: int) -> tuple[int, int]:
    """Where piece ``i`` of ``np.array_split(range(n), parts)`` starts and ends."""
    q, r = divmod(n, parts)
    start = i * q + min(i, r)
    return start, start + q + (1 if i < r else 0)


@attrs.define
class _Drawn:
    """The last split's draw, kept for the labels array (by identity) it was drawn for."""

    key: Any = None
    labels: Any = None
    value: Any = None

    def get(self, labels: np.ndarray, key: Any, draw: Any) -> Any:
        if self.labels is not labels or self.key != key:
            self.value = draw()
            self.labels, self.key = labels, key
        return self.value


def _label_ids(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct labels (ascending) and each row's index among them."""
    return np.unique(labels, return_inverse=True)


def _entropy(label: Any, index: int) -> int:
    """What seeds one label's draws: its value when it is an integer, else its position."""
    value = np.asarray(label)
    if value.dtype.kind in "iub" and int(value) >= 0:
        return int(value)
    return index


@attrs.frozen
class Contiguous:
    """Row blocks in the data's order; the last client takes the remainder.

    The rows every run trained on before partitioners existed (the same
    blocks as :func:`meshkit.train.shard_bounds`), so such runs stay bit
    for bit what they were.
    """

    options: NoOptions = NoOptions()

    def split(self, labels: np.ndarray, clients: int, *, seed: int) -> list[np.ndarray]:
        return [np.arange(a, b) for a, b in shard_bounds(len(labels), clients)]

    def client_rows(self, labels: np.ndarray, clients: int, client: int, *,
                    seed: int) -> np.ndarray:
        size = len(labels) // clients
        end = len(labels) if client == clients - 1 else (client + 1) * size
        return np.arange(client * size, end)


@attrs.frozen
class Iid:
    """A seeded shuffle cut into parts whose sizes differ by at most one."""

    options: NoOptions = NoOptions()

    _drawn: _Drawn = attrs.field(factory=_Drawn, eq=False, repr=False, init=False)

    def split(self, labels: np.ndarray, clients: int, *, seed: int) -> list[np.ndarray]:
        order = _rng(seed, "iid").permutation(len(labels))
        return [np.sort(part) for part in np.array_split(order, clients)]

    def client_rows(self, labels: np.ndarray, clients: int, client: int, *,
                    seed: int) -> np.ndarray:
        order = self._drawn.get(labels, (len(labels), seed),
                                lambda: _rng(seed, "iid").permutation(len(labels)))
        start, end = _piece(len(labels), clients, client)
        return np.sort(order[start:end])


@attrs.frozen
class Dirichlet:
    """Label skew (Hsu et al. 2019): label k's rows go to the clients in proportions
    drawn from Dirichlet(alpha, ..., alpha).

    Each label's proportions are drawn from a stream seeded by the run seed and
    the label itself, so a held-out set with the same labels is split with
    the same skew. A small alpha can leave a client without a row; the
    kernel refuses that split, saying to raise alpha, use fewer clients or
    another seed.
    """

    options: DirichletOptions = DirichletOptions()
    _drawn: _Drawn = attrs.field(factory=_Drawn, eq=False, repr=False, init=False)

    def _draw(self, labels: np.ndarray, clients: int, seed: int
              ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per label: its rows shuffled, and where each client's piece starts (clients + 1)."""
        values, index = _label_ids(np.asarray(labels))
        drawn = []
        for k, value in enumerate(values):
            rng = _rng(seed, "dirichlet", _entropy(value, k))
            share = rng.dirichlet(np.full(clients, float(self.options.alpha)))
            rows = np.flatnonzero(index == k)
            rows = rows[rng.permutation(len(rows))]
            cuts = np.round(np.cumsum(share)[:-1] * len(rows)).astype(np.int64)
            drawn.append((rows, np.concatenate([[0], cuts, [len(rows)]])))
        return drawn

    def split(self, labels: np.ndarray, clients: int, *, seed: int) -> list[np.ndarray]:
        drawn = self._draw(labels, clients, seed)
        return [self._rows(drawn, c) for c in range(clients)]

    def client_rows(self, labels: np.ndarray, clients: int, client: int, *,
                    seed: int) -> np.ndarray:
        drawn = self._drawn.get(labels, (clients, seed),
                                lambda: self._draw(labels, clients, seed))
        return self._rows(drawn, client)

    @staticmethod
    def _rows(drawn: list[tuple[np.ndarray, np.ndarray]], client: int) -> np.ndarray:
        # np.split's pieces: a cut past the next one leaves an empty piece
        pieces = [rows[bounds[client]:max(bounds[client], bounds[client + 1])]
                  for rows, bounds in drawn]
        return np.sort(np.concatenate(pieces)) if pieces else np.zeros(0, np.int64)


@attrs.frozen
class Pathological:
    """Each client holds ``classes_per_client`` labels (McMahan et al. 2017's shards).

    The labels are dealt to the clients round-robin from a seeded shuffle,
    client c taking the next ``classes_per_client``; each label's rows are
    then shuffled and cut evenly among the clients holding it. Every row needs
    a client, so the clients must cover every label.
    """

    options: PathologicalOptions = PathologicalOptions()
    _drawn: _Drawn = attrs.field(factory=_Drawn, eq=False, repr=False, init=False)

    def client_rows(self, labels: np.ndarray, clients: int, client: int, *,
                    seed: int) -> np.ndarray:
        deck, drawn = self._drawn.get(labels, (clients, seed),
                                      lambda: self._draw(labels, clients, seed))
        per = self.options.classes_per_client
        held = sorted({int(deck[(client * per + j) % len(deck)]) for j in range(per)})
        pieces = []
        for k in held:
            rows, owners = drawn[k]
            start, end = _piece(len(rows), len(owners), int(np.searchsorted(owners, client)))
            pieces.append(rows[start:end])
        return np.sort(np.concatenate(pieces))

    def _draw(self, labels: np.ndarray, clients: int, seed: int
              ) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
        """The deck, and per label its rows shuffled and its holders (ascending), as split draws."""
        values, index = self._labels(labels, clients)
        per = self.options.classes_per_client
        rng = _rng(seed, "pathological")
        deck = rng.permutation(len(values))
        dealt = np.arange(clients, dtype=np.int64).repeat(per)
        label_of = deck[(dealt * per + np.tile(np.arange(per), clients)) % len(values)]
        drawn = []
        for k in range(len(values)):
            rows = np.flatnonzero(index == k)
            rows = rows[rng.permutation(len(rows))]
            drawn.append((rows, np.unique(dealt[label_of == k])))
        return deck, drawn

    def _labels(self, labels: np.ndarray, clients: int) -> tuple[np.ndarray, np.ndarray]:
        values, index = _label_ids(np.asarray(labels))
        per = self.options.classes_per_client
        if per > len(values):
            raise ConfigError(
                f"[partitioner] classes_per_client = {per}, but the training set has only "
                f"{len(values)} labels; use 1..{len(values)}")
        if clients * per < len(values):
            need = -(-len(values) // per)
            raise ConfigError(
                f"[partitioner] {clients} clients x classes_per_client = {per} cover only "
                f"{clients * per} of the {len(values)} labels, and every row needs a client; "
                f"use at least {need} clients or classes_per_client >= "
                f"{-(-len(values) // clients)}")
        return values, index

    def split(self, labels: np.ndarray, clients: int, *, seed: int) -> list[np.ndarray]:
        values, index = self._labels(labels, clients)
        per = self.options.classes_per_client
        rng = _rng(seed, "pathological")
        deck = rng.permutation(len(values))
        holders: list[list[int]] = [[] for _ in values]
        for c in range(clients):
            for j in range(per):
                holders[deck[(c * per + j) % len(values)]].append(c)
        parts: list[list[np.ndarray]] = [[] for _ in range(clients)]
        for k in range(len(values)):
            rows = np.flatnonzero(index == k)
            rows = rows[rng.permutation(len(rows))]
            owners = sorted(set(holders[k]))
            for c, piece in zip(owners, np.array_split(rows, len(owners))):
                parts[c].append(piece)
        return [np.sort(np.concatenate(p)) if p else np.zeros(0, np.int64) for p in parts]


@attrs.frozen
class Local:
    """No simulation: each node's own training data is one client, served by that node."""

    options: NoOptions = NoOptions()
    per_node = True

    def split(self, labels: np.ndarray, clients: int, *, seed: int) -> list[np.ndarray]:
        if clients != 1:
            raise ConfigError(
                f"[partitioner] local: each node's own data is one client, so a node's data "
                f"is never split into {clients}; the run has one client per worker")
        return [np.arange(len(labels))]
