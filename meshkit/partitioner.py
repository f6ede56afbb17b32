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

At scale (many clients) a partitioner may also offer the *lazy* form::

    rows = partitioner.client_rows(labels, clients, client, seed=seed)

one client's rows, equal to ``split(labels, clients, seed=seed)[client]``
but computed without the other clients' lists (what it may cache is a
function of the labels, the count and the seed alone, e.g. one seeded
permutation of the rows). A worker asks for it per fit, so a node never
holds every client's row list; :func:`rows_of_client` checks what it gives.
Every built-in offers it.

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
           "DEFAULT_PARTITIONER", "is_lazy", "rows_of_client", "check_client_rows"]

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
        array = check_client_rows(part, rows, c, name=name)
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


def is_lazy(partitioner: Any) -> bool:
    """Whether the partitioner computes one client's rows alone (``client_rows``)."""
    return callable(getattr(partitioner, "client_rows", None))


def check_client_rows(part: Any, rows: int, client: int, *, name: str) -> np.ndarray:
    """One client's rows as the contract wants them (1-D, ascending, distinct, in range, some).

    What one client's rows alone can show; that every row is in exactly one
    client needs them all (:func:`check_split`).
    """
    array = np.asarray(part)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise ConfigError(f"partitioner {name!r}: client {client}'s part must be a 1-D array "
                          f"of row numbers, got {array.dtype}{list(array.shape)}")
    array = array.astype(np.int64, copy=False)
    if array.size == 0:
        raise ConfigError(
            f"partitioner {name!r} gave client {client} no rows; every client needs at least "
            f"one. Use fewer clients, another [run] seed, or options that spread the rows "
            f"more evenly (for dirichlet, a larger alpha)")
    if array.min() < 0 or array.max() >= rows:
        raise ConfigError(f"partitioner {name!r}: client {client} has row numbers outside "
                          f"0..{rows - 1}")
    if array.size > 1 and np.any(array[1:] <= array[:-1]):
        raise ConfigError(f"partitioner {name!r}: client {client}'s rows must be ascending and "
                          f"distinct")
    return array


def rows_of_client(partitioner: Any, labels: Any, clients: int, client: int, *, seed: int,
                   name: str = "partitioner") -> np.ndarray:
    """Client ``client``'s rows by the lazy form (``client_rows``), checked (what a worker calls)."""
    labels = np.asarray(labels) if not isinstance(labels, np.ndarray) else labels
    if not 0 <= client < clients:
        raise ConfigError(f"client {client} requested, but there are only {clients}")
    if len(labels) < clients:
        raise ConfigError(
            f"[partitioner] {name}: cannot split {len(labels)} rows into {clients} clients: "
            f"every client needs at least one row; use at most {len(labels)} clients")
    return check_client_rows(partitioner.client_rows(labels, clients, client, seed=seed),
                             len(labels), client, name=name)
