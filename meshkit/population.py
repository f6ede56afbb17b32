"""Populations: a task that describes N clients without materialising them (a client is a row).

A task is a *population* when it offers, besides the :class:`meshkit.task.Task`
methods::

    population() -> int                   # N, how many clients there are
    client_data(client) -> (x, y)         # that client's training rows, made on demand
    client_test_data(client) -> (x, y)    # optional: its held-out rows

Each is a pure function of the task's options (its seed among them) and the
client number, so every node makes the same client from nothing but its
number: no split is computed, no row list travels, and a client's data
exists only while a worker trains or evaluates it (the worker keeps no copy
between requests). The built-in ``synthetic-federated`` task is one
(LEAF's synthetic(alpha, beta), docs/simulation.md).

What changes when the task is a population: the run has ``population()``
clients (``[strategy] clients`` may be left out, or must say the same
number); a fit of client ``c`` trains on ``client_data(c)`` and the
``[partitioner]`` table does not apply (there is no one training set to
split); ``[strategy] evaluate = "clients"`` evaluates on
``client_test_data(c)``. ``train_data()`` stays what a strategy without
clients (``local``, ``data-parallel``) trains on; a population task chooses
what that is (``synthetic-federated``: a fixed few clients' rows pooled).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from meshkit.errors import ConfigError

__all__ = ["Population", "is_population", "population_size", "client_rows_of",
           "client_held_out_of"]


@runtime_checkable
class Population(Protocol):
    """What a task offers to be a population of clients (module docstring)."""

    def population(self) -> int:
        """How many clients there are (at least one)."""

    def client_data(self, client: int) -> tuple[Any, Any]:
        """Client ``client``'s training inputs and targets, rows paired."""


def is_population(task: Any) -> bool:
    """Whether ``task`` describes its clients itself (``population()`` and ``client_data()``)."""
    return callable(getattr(task, "population", None)) and callable(
        getattr(task, "client_data", None))


def population_size(task: Any) -> int | None:
    """``task.population()`` checked (None: the task is no population)."""
    if not is_population(task):
        return None
    size = task.population()
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"task {type(task).__name__}: population() must be a whole number "
                          f"of clients, at least 1; got {size!r}")
    return size


def _client(task: Any, client: int, count: int) -> None:
    size = population_size(task)
    if size is None:
        raise ConfigError(f"task {type(task).__name__} is not a population (it has no "
                          f"population() and client_data())")
    if count != size:
        raise ConfigError(f"the run asks for client {client} of {count}, but the task's "
                          f"population has {size} clients; set [strategy] clients = {size} "
                          f"(or leave it out)")
    if not 0 <= client < size:
        raise ConfigError(f"client {client} requested, but the population has clients "
                          f"0..{size - 1}")


def client_rows_of(task: Any, client: int, count: int) -> tuple[Any, Any]:
    """Client ``client``'s training data (``count``: the clients the run believes there are)."""
    _client(task, client, count)
    x, y = task.client_data(client)
    if len(x) != len(y) or len(y) == 0:
        raise ConfigError(f"task {type(task).__name__}: client_data({client}) gave {len(x)} "
                          f"inputs and {len(y)} targets; they must pair, at least one row")
    return x, y


def client_held_out_of(task: Any, client: int, count: int) -> tuple[Any, Any]:
    """Client ``client``'s held-out data, or a :class:`ConfigError` when the task has none."""
    _client(task, client, count)
    held_out = getattr(task, "client_test_data", None)
    if not callable(held_out):
        raise ConfigError(f"task {type(task).__name__} is a population without "
                          f"client_test_data(): its clients have no held-out data to "
                          f"evaluate on; use [strategy] evaluate = \"coordinator\"")
    x, y = held_out(client)
    return x, y
