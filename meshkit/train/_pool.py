"""Reaching the workers from the coordinator, and where a dead rank leaves a round.

A pool sends a round's requests and collects one :class:`Reply` per request,
in request order. A worker that disconnects, fails a send or stalls past the
deadline is answered *for* with ``payload=None`` and the reason; from then
on :class:`GroupPool` never waits on it again and tells the transport's dead
ledger, so a late frame from it cannot be mistaken for a live one.
:class:`LocalPool` runs the same protocol in-process (tests, the contract
suite), with ``fail`` to simulate a lost worker.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Mapping, Protocol, Sequence

import attrs

from meshkit.errors import PeerLostError, WireError
from meshkit.train._protocol import TAG_REPLY, TAG_REQUEST, decode, encode
from meshkit.train._worker import Trainer

__all__ = ["Reply", "WorkerPool", "LocalPool", "GroupPool"]

log = logging.getLogger(__name__)


@attrs.frozen
class Reply:
    """A worker's answer to one request (``None`` payload: the worker was lost)."""

    rank: int
    payload: Mapping[str, Any] | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.payload is not None


class WorkerPool(Protocol):
    """Sends requests to workers and collects their replies.

    ``call`` sends every request, then waits (at most ``timeout`` seconds
    overall) for each answer. A worker that disconnects or stalls gets a
    :class:`Reply` with ``payload=None`` and the reason, in request order.
    """

    def call(self, requests: Sequence[tuple[int, Mapping[str, Any]]],
             timeout: float | None) -> list[Reply]: ...

    def close(self) -> None: ...


@attrs.define
class LocalPool:
    """In-process workers: one :class:`Trainer` per rank, called directly.

    For tests and for strategies on a single machine without processes.
    ``fail(rank, request)`` may return a reason to simulate a lost worker.
    """

    trainers: dict[int, Trainer]
    fail: Callable[[int, Mapping[str, Any]], str | None] | None = None
    log: list[tuple[int, dict[str, Any]]] = attrs.Factory(list)

    @classmethod
    def of(cls, task_factory: Callable[[], Any], ranks: Sequence[int], **kw: Any) -> LocalPool:
        return cls({r: Trainer(task_factory()) for r in ranks}, **kw)

    def call(self, requests: Sequence[tuple[int, Mapping[str, Any]]],
             timeout: float | None) -> list[Reply]:
        replies = []
        for rank, request in requests:
            self.log.append((rank, dict(request)))
            reason = self.fail(rank, request) if self.fail else None
            if reason:
                replies.append(Reply(rank, None, reason))
                continue
            # Round-trip through the wire encoding, so tests exercise it.
            reply = decode(encode(self.trainers[rank].handle(decode(encode(request)))))
            replies.append(Reply(rank, reply))
        return replies

    def close(self) -> None:
        pass


@attrs.define
class GroupPool:
    """Reaches workers through a transport group (the coordinator is rank 0)."""

    group: Any
    _seq: int = 0
    _lost: dict[int, str] = attrs.Factory(dict)

    def call(self, requests: Sequence[tuple[int, Mapping[str, Any]]],
             timeout: float | None) -> list[Reply]:
        per_rank: dict[int, int] = {}
        pending: list[tuple[int, int]] = []
        for rank, request in requests:
            self._seq += 1
            per_rank[rank] = per_rank.get(rank, 0) + 1
            if rank not in self._lost:
                try:
                    self.group.send(rank, TAG_REQUEST, encode({**request, "seq": self._seq}))
                except (PeerLostError, WireError, OSError) as exc:
                    self._lost[rank] = f"send failed: {exc}"
            pending.append((rank, self._seq))
        # A worker serves its requests one after another, so its budget grows
        # with how many it was given.
        busiest = max(per_rank.values(), default=1)
        deadline = None if timeout is None else time.monotonic() + timeout * busiest
        replies = []
        for rank, seq in pending:
            if rank in self._lost:
                replies.append(Reply(rank, None, self._lost[rank]))
                continue
            try:
                replies.append(Reply(rank, self._receive(rank, seq, deadline)))
            except (PeerLostError, WireError, TimeoutError, OSError) as exc:
                reason = str(exc) or type(exc).__name__
                if isinstance(exc, TimeoutError):
                    reason = f"no answer within {timeout:g} s (stalled)"
                self._lost[rank] = reason
                self._declare_dead(rank, reason)
                replies.append(Reply(rank, None, reason))
        return replies

    def _receive(self, rank: int, seq: int, deadline: float | None) -> dict[str, Any]:
        for _ in range(1000):  # bounded: stale replies are few
            # Past the shared deadline a reply that already arrived still
            # counts: waiting on a slow rank must not condemn a prompt one.
            remaining = math.inf if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                frame = self.group.recv(rank, TAG_REPLY, timeout=remaining)
            except PeerLostError:
                if rank in getattr(self.group, "dead", {}):
                    raise
                raise TimeoutError from None
            reply = decode(frame)
            if reply.get("seq") == seq:
                return reply
            log.debug("rank %d: discarding a stale reply (seq %s, want %d)",
                      rank, reply.get("seq"), seq)
        raise WireError(f"rank {rank} sent too many unexpected replies")

    def _declare_dead(self, rank: int, reason: str) -> None:
        # Tell the transport's ledger, so it drops the link and a late frame
        # from the rank can never be mistaken for a live one.
        declare = getattr(self.group, "declare_dead", None)
        if callable(declare):
            try:
                declare(rank, reason)
            except Exception:  # best effort: the rank is dropped here regardless
                log.debug("declare_dead(%d) failed", rank, exc_info=True)

    def stop_all(self, ranks: Sequence[int]) -> None:
        """Tell workers the run is over (best effort: some may be gone)."""
        for rank in ranks:
            if rank in self._lost:
                continue
            try:
                self.group.send(rank, TAG_REQUEST, {"op": "stop", "seq": 0})
            except (PeerLostError, WireError, OSError):
                pass

    def close(self) -> None:
        pass
