"""A host relay's part in a secure round: it adds its ranks' masked vectors mod 2**bits.

Rule: behind a host relay (``meshkit relay``), a secure round's
``secagg_mask`` requests for the relay's ranks travel as one relay request,
``masked_sum``, and come back as one vector: the sum mod
``2**modulus_bits`` of the ranks' masked sums, with the clients it adds up.
The relay sees masked vectors only (each a worker's sum of masked inputs),
so it learns nothing a coordinator would not; the coordinator's link
carries one masked vector per relay instead of one per worker.

The request is flat (the wire's unit): ``ranks`` lists the relay's ranks
asked, and rank number ``i`` of that list has its ``secagg_mask`` request's
fields as entries ``"<i>/<field>"`` (:func:`masked_sum_request`). The
relay (:func:`serve_masked_sum`) sends each rank its request, checks each
reply at the same boundary as the coordinator (its pool does), drops a
rank whose vector is not of the first one's length and dtype (a protocol
error for that rank), and answers ``{"op": "masked_sum", "clients": [...],
"vector": ..., "lost": [[rank, reason], ...]}`` (no ``vector`` when no rank
answered). Vectors come in and go out as the field's wire form
(:func:`meshkit.secure_aggregation.to_wire`: packed at ``modulus_bits``
bits an element, with ``elements``, below 32 bits); the relay adds them
unpacked, exactly, mod ``2**modulus_bits``. A rank whose task failed (an ``error`` reply) is one of the
``lost``, its reason starting ``failed: ``: the coordinator decides whether
that ends the run (``[strategy] accept_failures``).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from meshkit.errors import ProtocolError
from meshkit.secure_aggregation import add_mod, from_wire, to_wire
from meshkit.train._messages import MAX_CLIENT_ID, check_request
from meshkit.train._pool import WorkerPool
from meshkit.train._relay.pull import pull_each

__all__ = ["masked_sum_request", "serve_masked_sum", "parse_masked_sum_answer"]


def masked_sum_request(requests: Mapping[int, Mapping[str, Any]], modulus_bits: int,
                       timeout: float | None) -> dict[str, Any]:
    """The ``masked_sum`` relay request carrying each rank's ``secagg_mask`` request."""
    wire: dict[str, Any] = {"op": "masked_sum", "ranks": sorted(requests),
                            "modulus_bits": modulus_bits, "timeout": timeout}
    for i, rank in enumerate(sorted(requests)):
        for field, value in requests[rank].items():
            if field != "op":
                wire[f"{i}/{field}"] = value
    return wire


def _unpack(message: Mapping[str, Any]) -> tuple[dict[int, dict[str, Any]], int, float | None]:
    """The per-rank requests, modulus bits and timeout of a ``masked_sum``; ProtocolError if not."""
    ranks, bits, timeout = message.get("ranks"), message.get("modulus_bits"), message.get(
        "timeout")
    if not isinstance(ranks, list) or not ranks or not all(
            type(r) is int and 1 <= r < 2 ** 31 for r in ranks) or len(set(ranks)) != len(ranks):
        raise ProtocolError(f"a masked_sum request's ranks must be distinct worker ranks, got "
                            f"{ranks!r}")
    if type(bits) is not int or not 1 <= bits <= 64:
        raise ProtocolError(f"a masked_sum request's modulus_bits must be 1..64, got {bits!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(
            timeout, (int, float)) or not 0 < timeout < 1e9):
        raise ProtocolError(f"a masked_sum request's timeout must be seconds > 0, got "
                            f"{timeout!r}")
    requests: dict[int, dict[str, Any]] = {r: {"op": "secagg_mask"} for r in ranks}
    for key, value in message.items():
        head, sep, field = key.partition("/")
        if not sep:
            if key not in ("op", "seq", "via", "ranks", "modulus_bits", "timeout"):
                raise ProtocolError(f"a masked_sum request has an unknown field {key!r}")
            continue
        if not head.isdigit() or int(head) >= len(ranks):
            raise ProtocolError(f"a masked_sum request's entry {key!r} names no rank it lists")
        requests[ranks[int(head)]][field] = value
    for request in requests.values():
        check_request(request)  # each inner request fits secagg_mask's schema
    return requests, bits, None if timeout is None else float(timeout)


def serve_masked_sum(pool: WorkerPool, carried: frozenset[int],
                     message: Mapping[str, Any]) -> dict[str, Any]:
    """A relay's answer to ``masked_sum`` (module docstring), served on its own ranks."""
    requests, bits, timeout = _unpack(message)
    outside = sorted(set(requests) - carried)
    if outside:
        raise ProtocolError(f"a masked_sum request for ranks {outside}, which this relay does "
                            f"not carry")
    total: np.ndarray | None = None
    clients: list[int] = []

    def take(rank: int, payload: Mapping[str, Any]) -> None:
        nonlocal total
        asked = set(requests[rank]["clients"])
        try:
            vector = from_wire(payload, bits)
            shape = f"{vector.dtype}{list(vector.shape)}"
        except ValueError as exc:
            vector, shape = None, f"a vector that does not fit the field ({exc})"
        if vector is None or total is not None and (
                vector.shape != total.shape or vector.dtype != total.dtype) \
                or not set(payload["clients"]) <= asked:
            raise ProtocolError(
                f"a masked input of clients {list(payload['clients'])} and {shape}, where the "
                f"relay's others are "
                f"{'none' if total is None else f'{total.dtype}{list(total.shape)}'} and it "
                f"was asked for {sorted(asked)}")
        total = vector.copy() if total is None else add_mod(total, vector, bits, out=total)
        clients.extend(int(c) for c in payload["clients"])

    lost = pull_each(pool, requests, timeout, take)
    answer: dict[str, Any] = {"op": "masked_sum", "clients": sorted(clients), "lost": lost}
    if total is not None:
        answer.update(to_wire(total, bits))
    return answer


def parse_masked_sum_answer(answer: Mapping[str, Any], asked: list[int], modulus_bits: int
                            ) -> tuple[list[int], np.ndarray | None, list[tuple[int, str]]]:
    """A relay's ``masked_sum`` answer, checked: (clients, vector or None, lost ranks), the
    vector unpacked (:func:`meshkit.secure_aggregation.from_wire`)."""
    clients, vector, lost = answer.get("clients"), answer.get("vector"), answer.get("lost")
    if answer.get("op") != "masked_sum" or not isinstance(clients, list) or not all(
            type(c) is int and 0 <= c <= MAX_CLIENT_ID for c in clients) \
            or clients != sorted(set(clients)) or not set(clients) <= set(asked):
        raise ProtocolError(f"a malformed answer to 'masked_sum': clients {clients!r} (asked "
                            f"for {asked})")
    if (vector is None) != (not clients) or vector is not None and (
            not isinstance(vector, np.ndarray) or vector.ndim != 1
            or vector.dtype not in (np.dtype(np.uint32), np.dtype(np.uint64),
                                    np.dtype(np.uint8))):
        raise ProtocolError("a malformed answer to 'masked_sum': its vector must be a 1-d "
                            "uint32, uint64 or packed uint8 array, present exactly when it "
                            "names clients")
    if vector is not None:
        try:
            vector = from_wire(answer, modulus_bits)
        except ValueError as exc:
            raise ProtocolError(f"a malformed answer to 'masked_sum': {exc}") from None
    if not isinstance(lost, list) or not all(
            isinstance(e, list) and len(e) == 2 and type(e[0]) is int
            and isinstance(e[1], str) for e in lost):
        raise ProtocolError("a malformed answer to 'masked_sum': lost must be [rank, reason] "
                            "pairs")
    return clients, vector, [(int(r), str(why)) for r, why in lost]
