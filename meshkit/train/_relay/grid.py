"""A host relay's part in a grid round: it adds its ranks' integer sums of codes, exactly.

Rule: in a compressed batched round with ``[compression] clip_range``
(:mod:`meshkit.train._rounds.compressed`) each worker holds one exact
integer sum of its clients' codes on the shared grid
(:class:`meshkit.compression.CodeSum`). Behind a host relay (``meshkit
relay``) the coordinator does not pull each rank's sum: it sends the relay
one ``grid_sum`` request naming its ranks, and the relay sends each a
``take_partial``, adds their sums as integers
(:class:`meshkit.compression.GridTotal`: no model, no compressor, nothing
rounded) and answers with one sum, packed at the width its total needs --
so the coordinator's link carries one compressed-model-sized sum per
relay, and the result is the bits of adding each client's codes at the
coordinator (integer addition does not depend on grouping).

The request: ``{"op": "grid_sum", "ranks": [...], "timeout": seconds}``.
The answer: ``{"op": "grid_sum", "ranks": [ranks summed], "lost": [[rank,
reason], ...], "partial": <the sum's wire>}`` (no ``partial`` when no rank
was summed). A rank lost, or whose task failed (``failed: ...``), is one of
the ``lost``; a rank whose sum does not fit the others' is declared dead
(a protocol error) and is one of them too: the coordinator serves the
clients it held again.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from meshkit.compression import GridTotal
from meshkit.errors import ProtocolError
from meshkit.train._pool import WorkerPool
from meshkit.train._relay.pull import pull_each

__all__ = ["grid_sum_request", "serve_grid_sum", "parse_grid_sum_answer"]


def grid_sum_request(ranks: Sequence[int], timeout: float | None) -> dict[str, Any]:
    """The ``grid_sum`` relay request for ``ranks`` (each holding a grid sum)."""
    return {"op": "grid_sum", "ranks": sorted(ranks), "timeout": timeout}


def _ranks(message: Mapping[str, Any]) -> tuple[list[int], float | None]:
    ranks, timeout = message.get("ranks"), message.get("timeout")
    if not isinstance(ranks, list) or not ranks or not all(
            type(r) is int and 1 <= r < 2 ** 31 for r in ranks) or len(set(ranks)) != len(ranks):
        raise ProtocolError(f"a grid_sum request's ranks must be distinct worker ranks, got "
                            f"{ranks!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(
            timeout, (int, float)) or not 0 < timeout < 1e9):
        raise ProtocolError(f"a grid_sum request's timeout must be seconds > 0, got "
                            f"{timeout!r}")
    unknown = sorted(set(message) - {"op", "seq", "via", "ranks", "timeout"})
    if unknown:
        raise ProtocolError(f"a grid_sum request has unknown fields {unknown}")
    return ranks, None if timeout is None else float(timeout)


def serve_grid_sum(pool: WorkerPool, carried: frozenset[int],
                   message: Mapping[str, Any]) -> dict[str, Any]:
    """A relay's answer to ``grid_sum`` (module docstring), served on its own ranks."""
    ranks, timeout = _ranks(message)
    outside = sorted(set(ranks) - carried)
    if outside:
        raise ProtocolError(f"a grid_sum request for ranks {outside}, which this relay does "
                            f"not carry")
    total = GridTotal()
    summed: list[int] = []

    def take(rank: int, payload: Mapping[str, Any]) -> None:
        total.add(payload["partial"], source=f"rank {rank}'s grid sum")
        summed.append(rank)

    lost = pull_each(pool, {rank: {"op": "take_partial"} for rank in ranks}, timeout, take)
    answer: dict[str, Any] = {"op": "grid_sum", "ranks": sorted(summed), "lost": lost}
    if summed:
        answer["partial"] = total.to_wire()
    return answer


def parse_grid_sum_answer(answer: Mapping[str, Any], asked: Sequence[int]
                          ) -> tuple[list[int], Mapping[str, Any] | None, list[tuple[int, str]]]:
    """A relay's ``grid_sum`` answer, its shape checked: (ranks summed, the sum's wire or
    None, lost ranks). The sum itself is checked where it is merged
    (:meth:`meshkit.compression.CodeSum.merge`)."""
    ranks, partial, lost = answer.get("ranks"), answer.get("partial"), answer.get("lost")
    if answer.get("op") != "grid_sum" or not isinstance(ranks, list) or not all(
            type(r) is int for r in ranks) or ranks != sorted(set(ranks)) \
            or not set(ranks) <= set(asked):
        raise ProtocolError(f"a malformed answer to 'grid_sum': ranks {ranks!r} (asked for "
                            f"{sorted(asked)})")
    if (partial is None) != (not ranks) or partial is not None and not isinstance(
            partial, Mapping):
        raise ProtocolError("a malformed answer to 'grid_sum': its partial must be a sum, "
                            "present exactly when it names ranks")
    if not isinstance(lost, list) or not all(
            isinstance(e, list) and len(e) == 2 and type(e[0]) is int and e[0] in asked
            and e[0] not in ranks and isinstance(e[1], str) for e in lost):
        raise ProtocolError("a malformed answer to 'grid_sum': lost must be [rank, reason] "
                            "pairs of ranks it was asked for and did not sum")
    return ranks, partial, [(int(r), str(why)) for r, why in lost]
