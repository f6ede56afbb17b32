"""Which rows a client trains on, which clients a round asks, and the seed of each fit.

Every rule here is a pure function of the run seed, the round and the
client, never of the worker that happens to serve it: that is what keeps a
run reproducible when workers drop out or a run resumes.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from meshkit.errors import ConfigError

__all__ = ["shard_bounds", "shard_pair", "client_seed", "sample_clients", "poisson_clients"]


def shard_bounds(rows: int, n: int) -> list[tuple[int, int]]:
    """Row ranges of ``n`` contiguous shards; the last takes the remainder."""
    if n < 1:
        raise ConfigError(f"cannot split data into {n} shards; need at least one worker")
    if rows < n:
        raise ConfigError(
            f"cannot split {rows} rows into {n} shards: every shard needs at least one "
            f"row; use fewer clients or workers")
    size = rows // n
    return [(i * size, rows if i == n - 1 else (i + 1) * size) for i in range(n)]


def shard_pair(x: np.ndarray, y: np.ndarray | None, n: int
               ) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
    """Split inputs and targets into ``n`` shards *together*.

    Sharding ``x`` and handing every worker the whole ``y`` fails silently:
    a 4-row output against an 8-row target broadcasts instead of erroring,
    so each replica would train on pairs that were never pairs. Row counts
    that disagree are therefore an error naming both.
    """
    rows = len(x)
    if y is not None and len(y) != rows:
        raise ConfigError(
            f"sharding across {n} workers: the inputs have {rows} rows and the targets "
            f"have {len(y)}. Each shard pairs example i with target i, so the two must "
            f"agree")
    bounds = shard_bounds(rows, n)
    xs = [x[a:b] for a, b in bounds]
    ys = [None if y is None else y[a:b] for a, b in bounds]
    return xs, ys


def client_seed(seed: int, round_: int, client: int) -> int:
    """The seed of one client's fit in one round, independent of which worker runs it.

    Deriving it from (run seed, round, client) and not from the worker makes
    a run reproducible when workers drop out or a run resumes.
    """
    return int(np.random.SeedSequence([seed, round_, client]).generate_state(1)[0])


def cohort_size(clients: int, fraction: float, minimum: int = 1) -> int:
    """How many clients :func:`sample_clients` draws: ``ceil(fraction * clients)``, at least
    ``minimum`` (and one), at most ``clients``."""
    # Rounded first: 0.07 * 100 is 7.000000000000001 in binary floating
    # point, and its ceiling would sample an eighth client.
    return min(clients, max(1, minimum, math.ceil(round(fraction * clients, 9))))


def sample_clients(rng: Any, clients: int, fraction: float, minimum: int) -> list[int]:
    """``ceil(fraction * clients)`` distinct clients (at least ``minimum``), sorted.

    O(k) memory for k much smaller than ``clients``: numpy's choice without
    replacement then uses Floyd's algorithm, never a permutation of every client.
    """
    k = cohort_size(clients, fraction, minimum)
    if k >= clients:
        return list(range(clients))
    return sorted(int(c) for c in rng.choice(clients, size=k, replace=False))


#: The stream of the run seed Poisson sampling draws from (apart from fits' seeds).
_POISSON = 0x9015
#: Clients whose Poisson draws are made at once.
_BLOCK = 1 << 16


def poisson_clients(seed: int, round_: int, clients: int, q: float) -> list[int]:
    """Each client independently with probability ``q`` (``[strategy] sampling = "poisson"``).

    A function of (run seed, round): the cohort of a round is the same after
    a resume, and its size is Binomial(clients, q) -- the sampling the privacy
    accountant's amplification assumes. It may be empty.
    """
    rng = np.random.default_rng(np.random.SeedSequence([seed, round_, _POISSON]))
    # Drawn in blocks, so a round of a million clients holds one block, not a
    # million doubles; each double is one draw of the stream whatever the
    # block size, so the cohort is the same bits as one draw of `clients`.
    chosen: list[int] = []
    for start in range(0, clients, _BLOCK):
        block = rng.random(min(_BLOCK, clients - start))
        chosen.extend(int(c) + start for c in np.flatnonzero(block < q))
    return chosen
