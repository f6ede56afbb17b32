"""The partitioner contract: how a training set is split into clients, and what a split says.

A *partitioner* decides which rows of a training set each client of a
simulated federation trains on (DESIGN §4). Its one method::

    parts = partitioner.split(labels, clients, seed=seed)

returns ``clients`` arrays of row numbers (int64, ascending) into the
training set whose targets are ``labels``. The rule every partitioner keeps:
a split is a pure function of ``(labels, clients, seed)`` and its options,
so every node computes the same split from its own copy of the data and no
row list ever travels; every row goes to exactly one client, and no client
is empty. :func:`check_split` enforces that on whatever a partitioner
returned (the kernel calls it on every split), so a broken third-party
partitioner is an error naming it, not a silently smaller training set.

A partitioner whose ``per_node`` attribute is true (the built-in ``local``)
does not simulate anything: each node's own ``train_data()`` is one client,
served by that node only; the kernel never asks it to split (the
conformance kit still checks that ``split(labels, 1, seed)`` keeps every row
in that one client).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from meshkit.errors import ConfigError

__all__ = ["Partitioner", "check_split", "is_per_node", "label_counts", "split_rows",
           "DEFAULT_PARTITIONER"]

#: The partitioner a run uses when its config has no ``[partitioner]`` table:
#: contiguous row blocks, what every run did before partitioners existed.
DEFAULT_PARTITIONER = "contiguous"


@runtime_checkable
class Partitioner(Protocol):
    """What the kernel needs from a partitioner (built by a ``meshkit_partitioners`` factory)."""

    def split(self, labels: np.ndarray, clients: int, *, seed: int) -> Sequence[np.ndarray]:
        """``clients`` ascending arrays of row numbers, together covering every row once.

        ``labels`` are the training targets (one per row; a task without
        class labels gives any per-row array). Raise :class:`meshkit.ConfigError`
        for options the data cannot meet (more clients than rows, ...),
        saying what to change.
        """


def is_per_node(partitioner: Any) -> bool:
    """Whether each node's own data is one client (``local``) rather than a simulated split."""
    return bool(getattr(partitioner, "per_node", False))


def check_split(parts: Sequence[Any], rows: int, clients: int, *, name: str) -> list[np.ndarray]:
    """Refuse a split that breaks the contract; the parts as ascending int64 arrays.

    Every row in ``0..rows-1`` must be in exactly one of ``clients`` non-empty
    parts: a row left out would silently shrink the training set, a row in
    two parts would count twice in fedavg's weights.
    """
    parts = list(parts)
    if len(parts) != clients:
        raise ConfigError(f"partitioner {name!r} returned {len(parts)} parts for {clients} "
                          f"clients")
    arrays = []
    seen = np.zeros(rows, dtype=np.int64)
    for c, part in enumerate(parts):
        array = np.asarray(part)
        if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
            raise ConfigError(f"partitioner {name!r}: client {c}'s part must be a 1-D array "
                              f"of row numbers, got {array.dtype}{list(array.shape)}")
        array = array.astype(np.int64, copy=False)
        if array.size == 0:
            raise ConfigError(
                f"partitioner {name!r} gave client {c} no rows; every client needs at least "
                f"one. Use fewer clients, another [run] seed, or options that spread the rows "
                f"more evenly (for dirichlet, a larger alpha)")
        if array.min() < 0 or array.max() >= rows:
            raise ConfigError(f"partitioner {name!r}: client {c} has row numbers outside "
                              f"0..{rows - 1}")
        if np.any(np.diff(array) <= 0):
            raise ConfigError(f"partitioner {name!r}: client {c}'s rows must be ascending and "
                              f"distinct")
        seen[array] += 1
        arrays.append(array)
    twice = np.flatnonzero(seen > 1)
    missing = np.flatnonzero(seen == 0)
    if twice.size:
        raise ConfigError(f"partitioner {name!r} gave rows to more than one client (e.g. row "
                          f"{int(twice[0])}); every row belongs to exactly one")
    if missing.size:
        raise ConfigError(f"partitioner {name!r} left {missing.size} row(s) to no client (e.g. "
                          f"row {int(missing[0])}); every row belongs to exactly one")
    return arrays


def split_rows(partitioner: Any, labels: Any, clients: int, *, seed: int,
               name: str = "partitioner") -> list[np.ndarray]:
    """``partitioner.split`` checked against the contract (what the kernel calls)."""
    labels = np.asarray(labels)
    if clients < 1:
        raise ConfigError(f"cannot split data into {clients} clients; need at least one")
    if len(labels) < clients:
        raise ConfigError(
            f"[partitioner] {name}: cannot split {len(labels)} rows into {clients} clients: "
            f"every client needs at least one row; use at most {len(labels)} clients")
    return check_split(partitioner.split(labels, clients, seed=seed), len(labels), clients,
                       name=name)


def label_counts(labels: Any, parts: Sequence[np.ndarray]) -> list[dict[Any, int]]:
    """Each client's examples per label (labels as Python scalars, ascending)."""
    labels = np.asarray(labels)
    counts = []
    for part in parts:
        values, number = np.unique(labels[part], return_counts=True)
        counts.append({v.item(): int(n) for v, n in zip(values, number)})
    return counts
