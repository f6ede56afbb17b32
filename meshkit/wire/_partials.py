"""What a receiver keeps of a cut transfer, and for how long: bounded in bytes, count and time.

A resumable message (docs/wire.md §2.5) cut part-way leaves its receiver
holding a *partial*: the body's buffer with its first ``done`` segments
verified. A :class:`PartialStore`
keeps partials until the sender offers them again after a reconnect, and
never more than ``max_bytes`` of them (each counted at its whole body's size,
the buffer it holds), ``max_partials`` of them, or any of them longer than
``ttl`` seconds. Each peer (rank and proven key) also has its own quota,
``peer_bytes`` and ``peer_partials``: parking a partial evicts the oldest
partials *of the same peer* until it fits that peer's quota, and never
another peer's, so one peer's cut transfers cannot push out what another
peer will resume (issue 39). A partial that still does not fit the store's
totals after that, or is bigger than its peer's quota alone, is not kept. What became of a dropped
transfer (expired, evicted) is remembered, bounded too, so the answer to a
late offer says why it starts over instead of only that it does.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import attrs
import numpy as np

from meshkit.errors import ConfigError

#: How much a store keeps unless told otherwise: 1 GiB of partial bodies,
#: 16 partials, each for 120 s after its cut; a peer's own quota is the same
#: bytes and 4 partials unless told otherwise.
DEFAULT_PARTIAL_BYTES = 1 << 30
DEFAULT_PARTIAL_COUNT = 16
DEFAULT_PARTIAL_TTL = 120.0
DEFAULT_PEER_PARTIALS = 4
# Dropped transfers whose fate a late offer is told (expired, evicted, too big).
_REMEMBER = 256

# Why an offered transfer does not resume (the answer's status, docs/wire.md §2.5).
RESUMED = 0
UNKNOWN = 1
EXPIRED = 2
EVICTED = 3
LAYOUT = 4
COMPLETED = 5


class RESUME_STATUS:
    """The answer statuses by name (``wire.RESUME_STATUS.COMPLETED``, ...), for transports."""

    RESUMED = RESUMED
    UNKNOWN = UNKNOWN
    EXPIRED = EXPIRED
    EVICTED = EVICTED
    LAYOUT = LAYOUT
    COMPLETED = COMPLETED


STATUS_TEXT = {
    RESUMED: "resumed",
    UNKNOWN: "this end holds no partial of it (never cut here, already completed, or "
             "it keeps no partials)",
    EXPIRED: "its partial expired before the offer came",
    EVICTED: "its partial was evicted to make room for its sender's newer ones, or did "
             "not fit this end's bounds",
    LAYOUT: "the offer's size, segment count or segment size differs from the partial's; "
            "the partial is discarded",
    COMPLETED: "this end received it whole already: it is not to be sent again",
}


@attrs.define(eq=False)
class Partial:
    """A resumable message being received, or cut and kept: its body and what of it is verified."""

    id: bytes
    total: int
    count: int
    size: int
    kind: int
    tag: int
    sender: int
    flags: int
    #: Who sent it: the peer's rank and proven node key (None without one). A
    #: partial resumes only on a connection from the same peer.
    peer_rank: int
    peer_key: bytes | None
    body: np.ndarray = attrs.field(repr=False)
    #: Segments ``0 .. done - 1`` are verified and in ``body``.
    done: int = 0
    #: The whole body's digest, as the offer that claimed it announced (b"": not offered).
    digest: bytes = b""
    parked_at: float = 0.0


class PartialStore:
    """Cut transfers a receiver keeps for their senders to resume: bounded bytes, count, time.

    Thread-safe: every channel of a node may share one (a coordinator's
    workers all send to it). ``peer_bytes`` and ``peer_partials`` are each
    peer's own quota (default: ``max_bytes``, and 4 partials or
    ``max_partials`` if fewer). ``clock`` (monotonic seconds) is for tests.
    """

    def __init__(self, *, max_bytes: int = DEFAULT_PARTIAL_BYTES,
                 max_partials: int = DEFAULT_PARTIAL_COUNT, ttl: float = DEFAULT_PARTIAL_TTL,
                 peer_bytes: int | None = None, peer_partials: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if peer_bytes is None:
            peer_bytes = max_bytes
        if peer_partials is None:
            peer_partials = min(max_partials, DEFAULT_PEER_PARTIALS)
        if (max_bytes < 0 or max_partials < 0 or not ttl > 0 or peer_bytes < 0
                or peer_partials < 0):
            raise ConfigError(f"a partial store needs max_bytes >= 0, max_partials >= 0, "
                              f"ttl > 0 seconds, peer_bytes >= 0 and peer_partials >= 0; got "
                              f"{max_bytes}, {max_partials}, {ttl}, {peer_bytes}, "
                              f"{peer_partials}")
        self.max_bytes = max_bytes
        self.max_partials = max_partials
        self.peer_bytes = peer_bytes
        self.peer_partials = peer_partials
        self.ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._kept: OrderedDict[bytes, Partial] = OrderedDict()  # oldest first
        self._gone: OrderedDict[bytes, int] = OrderedDict()
        self._done: OrderedDict[bytes, tuple[int, bytes | None]] = OrderedDict()
        self._bytes = 0
        #: Bytes and partials kept per peer (rank, key): each peer's quota.
        self._peer_bytes: dict[tuple[int, bytes | None], int] = {}
        self._peer_count: dict[tuple[int, bytes | None], int] = {}
        #: Partials dropped to make room, and partials that expired (counters).
        self.evicted = 0
        self.expired = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the partial bodies kept now."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._kept)

    def __contains__(self, transfer_id: bytes) -> bool:
        return transfer_id in self._kept

    def peer_nbytes(self, peer_rank: int, peer_key: bytes | None = None) -> int:
        """Bytes of the partial bodies kept now for one peer (its quota's use)."""
        with self._lock:
            return self._peer_bytes.get((peer_rank, peer_key), 0)

    def park(self, partial: Partial) -> bool:
        """Keep a cut partial (evicting its own peer's oldest to make room); False if not kept.

        Only partials of the same peer are evicted, to fit that peer's quota
        and then the store's totals; a partial that still does not fit is
        not kept (and another peer's partials stay).
        """
        with self._lock:
            self._expire()
            self._drop(partial.id, None)
            if partial.done == 0:
                return False  # nothing verified: nothing to resume from
            peer = (partial.peer_rank, partial.peer_key)
            if (partial.total > min(self.max_bytes, self.peer_bytes) or not self.max_partials
                    or not self.peer_partials):
                self._remember(partial.id, EVICTED)
                return False
            own = [k for k, p in self._kept.items() if (p.peer_rank, p.peer_key) == peer]
            while own and (self._peer_bytes.get(peer, 0) + partial.total > self.peer_bytes
                           or self._peer_count.get(peer, 0) >= self.peer_partials
                           or self._bytes + partial.total > self.max_bytes
                           or len(self._kept) >= self.max_partials):
                self._drop(own.pop(0), EVICTED)
                self.evicted += 1
            if (self._bytes + partial.total > self.max_bytes
                    or len(self._kept) >= self.max_partials):
                # Full of other peers' partials: theirs stay, this one is not kept.
                self._remember(partial.id, EVICTED)
                self.evicted += 1
                return False
            partial.parked_at = self._clock()
            self._kept[partial.id] = partial
            self._bytes += partial.total
            self._peer_bytes[peer] = self._peer_bytes.get(peer, 0) + partial.total
            self._peer_count[peer] = self._peer_count.get(peer, 0) + 1
            return True

    def claim(self, transfer_id: bytes, digest: bytes, total: int, count: int, size: int,
              peer_rank: int, peer_key: bytes | None) -> tuple[Partial | None, int]:
        """Answer an offer: ``(partial, RESUMED)``, taken out of the store, or ``(None, why)``.

        A partial another peer sent is not this offer's (``UNKNOWN``, and it
        stays: its own sender may still come back). The offer's ``digest``
        is kept with the partial, to check the whole body against at the end.
        """
        with self._lock:
            self._expire()
            partial = self._kept.get(transfer_id)
            if partial is None:
                if self._done.get(transfer_id) == (peer_rank, peer_key):
                    return None, COMPLETED
                return None, self._gone.get(transfer_id, UNKNOWN)
            if partial.peer_rank != peer_rank or partial.peer_key != peer_key:
                return None, UNKNOWN
            if (partial.total, partial.count, partial.size) != (total, count, size):
                self._drop(transfer_id, LAYOUT)
                return None, LAYOUT
            self._drop(transfer_id, None)
            partial.digest = digest
            return partial, RESUMED

    def completed(self, transfer_id: bytes, peer_rank: int, peer_key: bytes | None) -> None:
        """Remember that a transfer arrived whole, so an offer of it is answered "do not resend".

        Its sender cannot tell a cut that lost the end of a message from one
        that came after it (the kernel took every byte either way), so it may
        offer a transfer this end completed; without this, "unknown" would
        make it send the message twice. Bound to the sender, as partials are.
        """
        with self._lock:
            self._done[transfer_id] = (peer_rank, peer_key)
            self._done.move_to_end(transfer_id)
            while len(self._done) > _REMEMBER:
                self._done.popitem(last=False)

    def discard(self, transfer_id: bytes, peer_rank: int, peer_key: bytes | None) -> None:
        """Forget a transfer's partial, if kept for this peer (its sender started it over)."""
        with self._lock:
            partial = self._kept.get(transfer_id)
            if partial is not None and (partial.peer_rank, partial.peer_key) == (peer_rank,
                                                                                 peer_key):
                self._drop(transfer_id, None)

    def _expire(self) -> None:
        now = self._clock()
        for key in [k for k, p in self._kept.items() if now - p.parked_at > self.ttl]:
            self._drop(key, EXPIRED)
            self.expired += 1

    def _drop(self, transfer_id: bytes, why: int | None) -> None:
        partial = self._kept.pop(transfer_id, None)
        if partial is not None:
            self._bytes -= partial.total
            peer = (partial.peer_rank, partial.peer_key)
            self._peer_bytes[peer] -= partial.total
            self._peer_count[peer] -= 1
            if not self._peer_count[peer]:
                del self._peer_bytes[peer], self._peer_count[peer]
        if why is not None:
            self._remember(transfer_id, why)

    def _remember(self, transfer_id: bytes, why: int) -> None:
        self._gone[transfer_id] = why
        self._gone.move_to_end(transfer_id)
        while len(self._gone) > _REMEMBER:
            self._gone.popitem(last=False)
