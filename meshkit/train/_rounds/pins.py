"""Which worker keeps a client's error-feedback residual (``[compression] residual = "worker"``).

Rule: where a client is served when its residual stays on a worker is decided here.

With the residual kept where the client trains, a client must be served by the
same worker round after round, or its residual is not there. So each client is
*pinned*: of the live ranks, the one with the highest ``blake2b(client, rank)``
(rendezvous hashing). That is stable while the ranks stay, and when a rank is
lost only *its* clients move (each to its next-highest rank); nobody else's
residual is stranded. A work item already pinned (``[partitioner] name =
"local"``: the client's data is on one node) keeps its rank.

What the coordinator keeps of a residual is no residual at all: for each client,
the rank that holds it and the seed of the fit that left it -- the client's
last fit that was *folded*. Each fit request names that seed
(``compress.residual.from``), and the worker feeds back the residual that fit
left (:class:`meshkit.train._worker.residuals.WorkerResiduals`), so a fit that
was served but not folded (lost reply, refused payload, a round played again)
leaves the next fit the residual the coordinator's store would have given it:
the same arithmetic as ``residual = "coordinator"``. A client whose pin moved
(its rank was lost) restarts from a zero residual; :attr:`ResidualPins.restarts`
counts them, and the round's metrics row carries ``residual_restarts``.

Nothing here is checkpointed: a resumed run's workers are fresh processes (or hold
residuals left after the checkpoint), so every client restarts from zero after
``--resume`` (docs/compression.md).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Mapping, Sequence

__all__ = ["ResidualPins", "pin"]

log = logging.getLogger(__name__)


def _score(client: int, rank: int) -> int:
    digest = hashlib.blake2b(f"{int(client)}/{int(rank)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def pin(client: int, live: Sequence[int]) -> int:
    """The rank of ``live`` that serves ``client`` (rendezvous hashing, module docstring)."""
    if not live:
        raise ValueError("no live rank to pin a client to")
    return max(live, key=lambda rank: (_score(client, rank), -rank))


class ResidualPins:
    """Per client: the rank holding its residual and the seed of the fit that left it."""

    def __init__(self) -> None:
        self.held: dict[int, tuple[int, int]] = {}
        #: Clients that moved to another rank (so restarted from a zero residual), in all;
        #: the round skeleton reports each round's share as ``residual_restarts``.
        self.restarts = 0

    def plan(self, clients: Sequence[tuple[int, int | None]], live: Sequence[int]
             ) -> dict[int, tuple[int, dict[str, Any]]]:
        """Each client of ``clients`` (``(key, rank it is pinned to or None)``): its rank, and
        its fit request's ``compress.residual`` field."""
        out: dict[int, tuple[int, dict[str, Any]]] = {}
        moved = 0
        for client, given in clients:
            rank = pin(client, live) if given is None else int(given)
            field: dict[str, Any] = {"client": int(client)}
            held = self.held.get(client)
            if held is not None and held[0] == rank:
                field["from"] = held[1]
            elif held is not None:
                moved += 1
                del self.held[client]
            out[client] = (rank, field)
        self.restarts += moved
        if moved:
            log.warning("[compression] residual = \"worker\": %d client(s) moved to another "
                        "worker (theirs was lost) and restart error feedback from a zero "
                        "residual", moved)
        return out

    def folded(self, served: Mapping[int, int], requests: Mapping[int, Mapping[str, Any]]
               ) -> None:
        """The round's folded fits: each client's residual is now the one its fit left on
        the rank that served it."""
        for client, rank in served.items():
            self.held[client] = (int(rank), int(requests[client]["seed"]))
