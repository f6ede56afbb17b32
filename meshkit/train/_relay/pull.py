"""A host relay's pull from each of its ranks: one request a rank, each reply taken or lost.

Rule: the relay's sums (:mod:`.secure`'s masked vectors, :mod:`.grid`'s
integer sums of codes) are gathered the same way. Each rank gets its
request at once; each reply is handed to the caller's ``take`` as it
arrives. A rank whose reply is lost (no payload), or whose task failed (an
``error`` reply: its reason starts ``failed: ``, and the coordinator decides
whether that ends the run, ``[strategy] accept_failures``), is one of the
``lost``; the others' stand. A reply ``take`` refuses with a
:class:`~meshkit.ProtocolError` is a protocol error of that rank: it is
declared dead in the relay's pool, and is one of the ``lost`` too.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from meshkit.errors import ProtocolError
from meshkit.train._pool import WorkerPool, protocol_reason

__all__ = ["pull_each"]


def pull_each(pool: WorkerPool, requests: Mapping[int, Mapping[str, Any]],
              timeout: float | None,
              take: Callable[[int, Mapping[str, Any]], None]) -> list[list[Any]]:
    """Send each rank its request and hand each reply's payload to ``take(rank, payload)``;
    the ``[rank, reason]`` pairs of the ranks lost (module docstring)."""
    tickets = {pool.send(rank, request, timeout): rank for rank, request in requests.items()}
    lost: list[list[Any]] = []
    for _ in tickets:
        reply = pool.receive()
        assert reply is not None  # a blocking receive always returns one
        rank = tickets[reply.seq]
        if reply.payload is None:
            lost.append([rank, reply.error or "lost"])
        elif reply.payload.get("error"):
            lost.append([rank, f"failed: {reply.payload['error']}"])
        else:
            try:
                take(rank, reply.payload)
            except ProtocolError as exc:
                reason = protocol_reason(exc)
                pool.declare_dead(rank, reason)
                lost.append([rank, reason])
    return lost
