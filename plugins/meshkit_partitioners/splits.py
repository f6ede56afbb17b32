"""The built-in splits, one class each; every one a pure function of (labels, clients, seed).

Each draws from its own seeded stream (the run seed and a constant naming
the partitioner), so a split does not change when something else in the
run draws random numbers, and every node computes the same split from its
own copy of the data.
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


@attrs.frozen
class Iid:
    """A seeded shuffle cut into parts whose sizes differ by at most one."""

    options: NoOptions = NoOptions()

    def split(self, labels: np.ndarray, clients: int, *, seed: int) -> list[np.ndarray]:
        order = _rng(seed, "iid").permutation(len(labels))
        return [np.sort(part) for part in np.array_split(order, clients)]


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

    def split(self, labels: np.ndarray, clients: int, *, seed: int) -> list[np.ndarray]:
        values, index = _label_ids(np.asarray(labels))
        parts: list[list[np.ndarray]] = [[] for _ in range(clients)]
        for k, value in enumerate(values):
            rng = _rng(seed, "dirichlet", _entropy(value, k))
            share = rng.dirichlet(np.full(clients, float(self.options.alpha)))
            rows = np.flatnonzero(index == k)
            rows = rows[rng.permutation(len(rows))]
            cuts = np.round(np.cumsum(share)[:-1] * len(rows)).astype(np.int64)
            for c, piece in enumerate(np.split(rows, cuts)):
                parts[c].append(piece)
        return [np.sort(np.concatenate(p)) if p else np.zeros(0, np.int64) for p in parts]


@attrs.frozen
class Pathological:
    """Each client holds ``classes_per_client`` labels (McMahan et al. 2017's shards).

    The labels are dealt to the clients round-robin from a seeded shuffle,
    client c taking the next ``classes_per_client``; each label's rows are
    then shuffled and cut evenly among the clients holding it. Every row needs
    a client, so the clients must cover every label.
    """

    options: PathologicalOptions = PathologicalOptions()

    def split(self, labels: np.ndarray, clients: int, *, seed: int) -> list[np.ndarray]:
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
