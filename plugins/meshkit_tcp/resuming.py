"""A star link cut part-way comes back: the worker redials, a cut transfer continues (issue 39).

Rule: everything the ``tcp`` transport does to resume a cut link is here,
and only with ``[mesh] resume_seconds > 0`` on a star without host relays
(:class:`TcpLinks` mixes this in; off, none of it runs and a lost link is a
dead peer at once, as before).

* **Which messages resume.** A message a rank sends itself whose encoded
  body is above the link's segment size (a model-sized one: the state out,
  a contribution back) goes out with :meth:`meshkit.wire.Channel.send_resumable`,
  as a :class:`meshkit.wire.Transfer` kept per peer: the ones being sent,
  and the last one sent whole (a send the kernel took may still have been
  cut on the way; the receiver answers COMPLETED if it has it, and it is
  not sent twice). Smaller messages, and frames a coordinator relays, are
  sent again whole on the new link when their write failed (a write that
  failed never delivered its frame: its tag comes last).
* **The worker redials.** Its reader, on losing the coordinator, dials it
  again in the same process for up to ``resume_seconds`` (attempts spaced
  :data:`REDIAL_PAUSE` apart), offering its kept transfers in the handshake
  and holding a :class:`meshkit.wire.PartialStore` for what it was
  receiving; the new channel replaces the old one and its reader goes on
  reading it. Only if no redial is welcomed in time is the coordinator lost.
* **The coordinator holds the link.** Its reader, on losing a worker, waits
  up to ``resume_seconds`` for that worker's redial before declaring it
  dead. A redial of a live rank proving the same node key (or none, as
  before) is admitted as a *replacement*: it takes the rank's place in the
  routing table without a death or a return in the membership, and the old
  channel is closed. The coordinator's offer is made once it knows who
  dialed (``handshake(offers=callable)``).
* **The transfers continue.** A send that failed waits for the replacement
  channel (bounded by ``resume_seconds`` plus the stall timeout) and sends
  the same transfer again on it: from the segment the receiver's answer
  names, checked by digest at the end. A kept transfer no sender is
  retrying (its send had returned) is continued by the redial itself,
  unless its answer is COMPLETED.

What this does not cover: a host relay's ranks and a mesh (``meshkit
check`` refuses the combination); a message whose write *succeeded* but
which the cut lost in the kernel's buffers is resent only if it was a
resumable one (the last one sent whole). A redial that reaches the
coordinator before it noticed the cut (a half-open connection, a busy
machine) closes the old link first and waits for its reader to park what
it was receiving (at most half the stall timeout), so the answer finds it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs

from meshkit import wire
from meshkit.errors import MeshError, PeerLostError
from meshkit.transport import LinkEvents
from meshkit_tcp.joining import ROLE_REDIAL

__all__ = ["PEER_PARTIALS", "REDIAL_PAUSE", "ResumingLinks"]

log = logging.getLogger(__name__)

#: Seconds between a worker's redial attempts (and the first one's delay at most).
REDIAL_PAUSE = 0.25
#: Cut transfers a node keeps per peer to resume.
PEER_PARTIALS = 4


@attrs.define(eq=False)
class _Kept:
    """A resumable message this rank sent (or is sending) to one peer."""

    kind: int
    tag: int
    transfer: wire.Transfer
    #: A transmit call is sending it (and will send it again after a cut).
    active: bool = True


class ResumingLinks:
    """The resume half of :class:`meshkit_tcp.links.TcpLinks` (see the module docstring)."""

    _lock: threading.Condition
    _channels: dict[int, wire.Channel]
    _events: LinkEvents
    _via: dict[int, str]
    config: Any
    rank: int
    world_size: int
    timeout: float
    is_star: bool
    bytes_out: int
    _sent: Callable[[int], None]

    def _init_resume(self) -> None:
        cfg = self.config
        #: Seconds a cut star link is held for its worker's redial (0: off).
        self.resume_seconds = float(cfg.resume_seconds) if self.is_star else 0.0
        self._resume = self.resume_seconds > 0
        peers = self.world_size - 1 if self.rank == 0 else 1
        #: What this rank keeps of transfers cut while it received them.
        self.partials: wire.PartialStore | None = None
        if self._resume:
            self.partials = wire.PartialStore(
                max_bytes=int(cfg.resume_bytes) * max(peers, 1),
                max_partials=PEER_PARTIALS * max(peers, 1), peer_bytes=int(cfg.resume_bytes),
                peer_partials=PEER_PARTIALS,
                ttl=max(wire.DEFAULT_PARTIAL_TTL, 2 * self.resume_seconds))
        self._kept: dict[int, list[_Kept]] = {}
        #: Redials this rank made that were welcomed, and links replaced by a redial.
        self.redials = 0
        self.replaced = 0
        #: Bytes a resumed transfer did not send again (segments the receiver had).
        self.resumed_bytes = 0
        self._stopping = threading.Event()
        #: Each link's reader sets its event once its read failed (a cut transfer parked).
        self._stopped: dict[wire.Channel, threading.Event] = {}

    # -- what to offer ---------------------------------------------------------------------

    def _offers_for(self, channel: wire.Channel) -> list[wire.Transfer]:
        """The transfers kept for the peer that just handshook (the coordinator's offer).

        Called once the dialer is authenticated and before its own offer is
        answered: a redial of a rank whose old link this end still reads
        (it has not noticed the cut yet: a half-open connection, a busy
        machine) closes that link first and waits, bounded, for its reader
        to let go of it, so the transfer it was receiving is parked for the
        answer to find.
        """
        rank = channel.peer.rank
        if rank in self._via:
            return []
        with self._lock:
            old = self._channels.get(rank)
            kept = [k.transfer for k in self._kept.get(rank, ()) if k.transfer.offerable()]
        if (old is not None and old is not channel and old.peer_key == channel.peer_key
                and channel.peer.role == ROLE_REDIAL):
            old.close("superseded by the peer's redial")
            stopped = self._stopped.get(old)
            if stopped is not None:
                stopped.wait(self.timeout / 2)  # the dialer waits on our offer
        return kept

    def _keep(self, peer: int, kind: int, tag: int, transfer: wire.Transfer) -> _Kept:
        entry = _Kept(kind, tag, transfer)
        with self._lock:
            kept = self._kept.get(peer, [])
            whole = [k for k in kept if not k.active and k.transfer.complete]
            # Those being sent, the last one sent whole, and this one.
            self._kept[peer] = [k for k in kept if k.active] + whole[-1:] + [entry]
        return entry

    def _forget(self, peer: int) -> None:
        with self._lock:
            self._kept.pop(peer, None)

    # -- sending ---------------------------------------------------------------------------

    def _send_resuming(self, peer: int, channel: wire.Channel,
                       attempt: Callable[[wire.Channel], int]) -> int:
        """``attempt(channel)``, again on the replacement channel after each cut (bounded)."""
        while True:
            try:
                return attempt(channel)
            except PeerLostError as exc:
                if not self._resume or self._events.closed:
                    raise
                channel = self._replacement(peer, channel, str(exc))

    def _send_model(self, peer: int, channel: wire.Channel, kind: int, tag: int,
                    state: Any, deadline: float | None) -> int:
        """Send a rank's own message; a model-sized one resumably when resume is on."""
        if not self._resume:
            return channel.send(kind, tag, state, deadline=deadline)
        encoded = wire.encode_state(state)
        if encoded.nbytes <= channel.segment_bytes:
            return self._send_resuming(peer, channel, lambda c: c.send_encoded(
                kind, tag, encoded, deadline=deadline))
        entry = self._keep(peer, kind, tag, wire.Transfer(encoded))
        try:
            return self._send_resuming(peer, channel,
                                       lambda c: self._continue(c, entry, deadline))
        finally:
            entry.active = False

    def _continue(self, channel: wire.Channel, entry: _Kept, deadline: float | None) -> int:
        transfer = entry.transfer
        sent = channel.send_resumable(entry.kind, entry.tag, transfer, deadline=deadline)
        if transfer.resumed_from or (transfer.answer is not None
                                     and transfer.answer.status == wire.RESUME_STATUS.COMPLETED):
            self.resumed_bytes += transfer.encoded.nbytes - sent
            log.info("rank %d: transfer %s to rank %d %s", self.rank, transfer.id.hex(),
                     channel.peer.rank,
                     "was received whole already" if sent == 0 else
                     f"resumed at segment {transfer.resumed_from} of {transfer.count}")
        return int(sent)

    def _replacement(self, peer: int, old: wire.Channel, reason: str) -> wire.Channel:
        """The channel that replaced ``old`` after a redial; PeerLostError if none came."""
        limit = self.resume_seconds + self.timeout
        with self._lock:
            self._lock.wait_for(lambda: self._channels.get(peer) is not old
                                or self._events.closed, limit)
            new = self._channels.get(peer)
        if new is None or new is old or self._events.closed:
            raise PeerLostError(f"rank {peer}'s link was cut ({reason}) and no redial replaced "
                                f"it within {limit:g} s")
        return new

    # -- after a redial --------------------------------------------------------------------

    def _resend_kept(self, peer: int, channel: wire.Channel) -> None:
        """Continue, on a replacement channel, the kept transfers no send is retrying."""
        with self._lock:
            idle = [k for k in self._kept.get(peer, ()) if not k.active]
        todo = []
        for entry in idle:
            answer = channel.resume_answers.get(entry.transfer.id)
            if answer is not None and answer.status == wire.RESUME_STATUS.COMPLETED:
                channel.resume_answers.pop(entry.transfer.id, None)
                continue
            if answer is not None:
                entry.active = True
                todo.append(entry)
        if not todo:
            return

        def run() -> None:
            for entry in todo:

                def attempt(c: wire.Channel, e: _Kept = entry) -> int:
                    return self._continue(c, e, None)

                try:
                    self._sent(self._send_resuming(peer, channel, attempt))
                except (MeshError, OSError) as exc:
                    log.warning("rank %d: continuing a cut transfer to rank %d failed: %s",
                                self.rank, peer, exc)
                    return
                finally:
                    entry.active = False

        threading.Thread(target=run, daemon=True,
                         name=f"meshkit-tcp-r{self.rank}-resume-{peer}").start()

    def _reading(self, channel: wire.Channel) -> threading.Event:
        """The event a link's reader sets once it stopped reading ``channel``."""
        stopped = threading.Event()
        with self._lock:
            # Forget the links whose readers stopped long ago.
            for gone in [c for c, e in self._stopped.items() if e.is_set() and c.closed]:
                del self._stopped[gone]
            self._stopped[channel] = stopped
        return stopped

    def _held(self, rank: int, channel: wire.Channel) -> bool:
        """Coordinator: whether ``rank``'s cut link was replaced by a redial (wait for it)."""
        if not self._resume or rank in self._via or self._events.closed:
            return False
        with self._lock:
            self._lock.wait_for(lambda: self._channels.get(rank) is not channel
                                or self._events.closed, self.resume_seconds)
            new = self._channels.get(rank)
        return new is not None and new is not channel

    def _replaceable(self, channel: wire.Channel) -> bool:
        """Coordinator: whether ``channel`` is a live rank's redial (reserving the rank if so).

        The same rank, not declared dead, not behind a relay, not already
        being admitted, proving the same node key (or none) as its link.
        """
        rank = channel.peer.rank
        if not self._resume or self._events.dead_reason(rank) is not None:
            return False
        with self._lock:
            old = self._channels.get(rank)
            if (old is None or rank in self._via or rank in self._admitting
                    or old.peer_key != channel.peer_key):
                return False
            self._admitting.add(rank)
        return True

    _admitting: set[int]

    def _redial_problem(self, rank: int) -> str:
        """Why a redial of ``rank`` that is not a replacement is refused."""
        why = self._events.dead_reason(rank)
        if not self._resume:
            return (f"rank {rank} redialed, but this coordinator holds no cut links "
                    f"([mesh] resume_seconds = 0); start the node again")
        if why is not None:
            return (f"rank {rank}'s cut link was not held: it was declared dead ({why}); "
                    f"start the node again")
        return (f"rank {rank}'s redial does not match its link (another node key, a host "
                f"relay's rank, or one being admitted already)")

    def _restarted(self, channel: wire.Channel) -> None:
        """Coordinator: a new node (not a redial) claims a rank whose cut link is held.

        Its old process is gone (a redial would say so in its role): the hold
        ends now and the rank is dead, so the new node is admitted as a
        restarted one (returning). A rank whose link still reads is left to
        the duplicate-rank check.
        """
        rank = channel.peer.rank
        with self._lock:
            old = self._channels.get(rank)
            stopped = self._stopped.get(old) if old is not None else None
        if stopped is not None and stopped.is_set() and old is not None and (
                old.peer_key == channel.peer_key):
            self._events.lost(rank, "its cut link was held for a redial, and a new node "
                                    "claimed its rank instead (restarted)")

    def _swap(self, rank: int, channel: wire.Channel) -> wire.Channel | None:
        """Put a redial's ``channel`` in ``rank``'s place; the old channel (closed), or None."""
        with self._lock:
            self._admitting.discard(rank)
            if self._events.closed:
                channel.close()
                return None
            old = self._channels.get(rank)
            self._channels[rank] = channel
            self.replaced += 1
            self._lock.notify_all()
        if old is not None and old is not channel:
            old.close("replaced by the peer's redial")
        return old

    def _redial_pause(self, deadline: float) -> bool:
        """Wait before the next redial attempt; False once out of time or closing."""
        left = deadline - time.monotonic()
        if left <= 0 or self._events.closed:
            return False
        self._stopping.wait(min(REDIAL_PAUSE, left))
        return not self._events.closed and time.monotonic() < deadline
