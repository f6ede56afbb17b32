"""The Group API every transport implements, and the machinery they share.

A transport plugin (component kind ``"transport"``) builds an object with
``connect(node_config) -> Group``. A :class:`Group` is this rank's handle on
the mesh. Ranks: the coordinator is rank 0, workers are ``1..world_size-1``.

Public API of a group (every built-in transport, ``tcp`` and ``inproc``)
-----------------------------------------------------------------------

``group.rank``, ``group.world_size``, ``group.timeout`` (seconds; the
default for every blocking call, from ``NodeConfig.timeout``),
``group.is_coordinator`` (``rank == 0``), ``group.is_star``.

``send(dst, tag, payload) -> None``
    Send a *state* (``Mapping[str, numpy.ndarray | JSON value]``) to rank
    ``dst``. ``tag`` is an int in ``0 .. 0xFFFFFFFF``; tags at or above
    :data:`RESERVED_TAGS` (``0xFFFF0000``) belong to the kernel (handshake,
    reduce service, capability handshake: :data:`TAG_CAPS`), and the reduce
    service's own tags are refused. In a star, worker-to-worker sends are
    relayed by the coordinator (workers only ever dial the coordinator).
    The payload is copied onto the wire before ``send`` returns, so the
    caller may reuse its arrays. A message for a worker that has not joined
    yet waits at the coordinator (up to 64 per rank) and is delivered when it
    joins. Raises :class:`~meshkit.PeerLostError` if
    ``dst`` is dead or unreachable, :class:`~meshkit.WireError` if the payload
    cannot be encoded.

``recv(src, tag, timeout=None) -> State``
    Block until a payload with ``tag`` from rank ``src`` arrives and return
    it. On the coordinator ``src`` may be :data:`ANY` (``None``): the next
    frame with that tag from any rank is returned as ``(src, state)``.
    Frames are delivered in arrival order per (source, tag). ``timeout``:
    ``None`` means ``group.timeout``; ``math.inf`` waits for ever (still
    raising if the peer is lost). A peer that is dead, disconnects, or sends
    nothing in time raises :class:`~meshkit.PeerLostError`; frames it
    completed before dying are still delivered first.

``all_reduce(state, weight=1.0, timeout=None, *, kind="model") -> State`` (workers)
    Contribute ``state`` with ``weight`` (realized work: examples seen, or
    1.0 for a plain mean) to the coordinator's current reduce round, block,
    and return the state the coordinator scattered (the consensus, stepped by
    the outer optimizer if one is configured). Never returns a local value:
    a lost coordinator or a timeout (default: twice ``group.timeout``, since the
    coordinator may itself wait one timeout for the slowest rank) is
    :class:`~meshkit.PeerLostError`, a
    broken frame :class:`~meshkit.WireError`, a round the coordinator refused
    (contributions that disagree) :class:`~meshkit.AggregationError` carrying
    the coordinator's message. ``kind="model"`` frames travel as bfloat16 when
    the transport's ``bf16_wire`` option is on (accumulation on the
    coordinator stays float32 or wider); ``kind="control"`` always travels
    exactly.

``reduce_round(aggregator, outer=None, global_state=None, timeout=None, *, contribution=None, weight=1.0) -> RoundResult`` (coordinator)
    One round of the star reduce service (see :mod:`meshkit.transport.reduce`): every
    live worker's contribution is folded as it arrives through
    ``meshkit.aggregation.begin(aggregator)``; workers that die, stall past
    ``timeout`` or fail authentication are declared dead and their
    contributions discarded; ``outer.step(global_state, consensus)`` runs when
    ``outer`` is given; one state is scattered to every surviving
    contributor. ``contribution``/``weight`` let the coordinator fold its own
    state too. When no contribution at all can be accepted (every worker
    dead) it raises :class:`~meshkit.PeerLostError` quoting the dead ledger:
    the service ends cleanly, it never invents a consensus.

``dead -> dict[int, str]``
    The dead-rank ledger: rank -> why it was declared dead. Deaths are
    permanent for the life of the group. ``declare_dead(rank, reason)`` adds to
    it (e.g. a strategy's own liveness check) and drops the rank's link.

``live_ranks -> list[int]``
    On the coordinator: workers that joined and are not dead. On a worker:
    the ranks it can still reach (``[0]`` in a star, the live peers in a mesh).

``joined -> list[int]``, ``wait_for_workers(timeout=None) -> list[int]`` (coordinator)
    Workers whose handshake completed; block until all ``world_size - 1``
    workers joined, raising :class:`~meshkit.PeerLostError` naming the ranks
    still missing at the timeout.

``address -> str``
    Where this rank can be reached (the coordinator's actual listen address
    ``host:port`` after binding port 0, ``inproc://name`` in-process).

``close()``
    Leave the mesh: peers see this rank's link as lost. Idempotent; a group is
    also a context manager.

Writing a transport
-------------------

Subclass :class:`GroupBase` and implement ``_transmit(peer, message,
timeout)`` (deliver one :class:`Message` over the direct link to ``peer``,
raising ``PeerLostError``/``WireError``) and ``_drop_link(peer)``; call
``_deliver(message)`` from your receive path and ``_link_lost(peer,
reason)`` when a link dies; call ``_joined_rank(rank)`` on the coordinator
when a worker's handshake completes. Routing (star relay), mailboxes, timeouts,
the dead ledger and the reduce service then come for free.

A star coordinator relays each destination's messages from that
destination's own queue and writer thread, so a rank that stops reading
holds up only what is sent to it. Optionally implement
``_relay_now(peer, message) -> bool`` to write a relayed message on the
spot when that cannot wait on the peer (``tcp``: the kernel has room for the
whole frame; ``inproc``: always), saving the thread hand-off.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping

import attrs

from meshkit.errors import MeshError, PeerLostError, WireError

if TYPE_CHECKING:
    from meshkit.transport.reduce import RoundResult

__all__ = [
    "ANY",
    "RESERVED_TAGS",
    "TAG_MAX",
    "TAG_WELCOME",
    "TAG_BYE",
    "TAG_REDUCE",
    "TAG_SCATTER",
    "TAG_CAPS",
    "TAG_CONTROL",
    "META_KEY",
    "Message",
    "GroupBase",
    "check_tag",
    "check_state",
    "deadline_after",
]

log = logging.getLogger(__name__)

#: ``recv(ANY, tag)`` on the coordinator takes the next frame from any rank.
ANY = None

#: Tags at or above this value belong to the kernel.
RESERVED_TAGS = 0xFFFF0000
TAG_MAX = 0xFFFFFFFF
#: The coordinator's answer to a worker's handshake (welcome or refusal).
TAG_WELCOME = 0xFFFF0000
#: A rank leaving the mesh on purpose (close()), so peers log it quietly.
TAG_BYE = 0xFFFF0003
#: A worker's contribution to a reduce round (reduce service only).
TAG_REDUCE = 0xFFFF0001
#: The state the coordinator scatters at the end of a round (reduce service only).
TAG_SCATTER = 0xFFFF0002
#: Capability handshake: a worker announces its ``NodeCaps`` to rank 0.
TAG_CAPS = 0xFFFF0010
#: Kernel control messages between the coordinator loop and node drivers.
TAG_CONTROL = 0xFFFF0011

#: Tags user code may not send: they would spoof the reduce service.
_SERVICE_TAGS = frozenset({TAG_WELCOME, TAG_REDUCE, TAG_SCATTER, TAG_BYE})

#: Relayed messages held per rank that has not joined yet (star coordinator).
_MAX_HELD = 64
#: The star coordinator relays to each rank from that rank's own queue and
#: writer thread, so a destination that stops reading holds up only the frames
#: for it. A queue takes this many messages and bytes (always at least one
#: message) before the reader that received the next one waits for room.
_RELAY_QUEUE = 64
_RELAY_QUEUE_BYTES = 64 << 20
#: A relay writer with nothing to send for this long ends (a new one starts
#: with the next message).
_RELAY_IDLE = 2.0

#: Reserved payload key carrying transport metadata (routing, round numbers);
#: a user state may not use it.
META_KEY = "__meshkit__"


def check_tag(tag: Any, *, service: bool = False) -> int:
    """Validate a tag; the reduce service's own tags only when ``service``."""
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= TAG_MAX:
        raise ValueError(f"a tag must be an int in 0..0x{TAG_MAX:X}, got {tag!r}")
    if tag in _SERVICE_TAGS and not service:
        raise ValueError(
            f"tag 0x{tag:X} is the reduce service's own; use all_reduce/reduce_round, "
            f"or a tag below 0x{RESERVED_TAGS:X} for your own messages")
    return tag


def check_state(payload: Any, what: str = "payload") -> Mapping[str, Any]:
    """A state must be a mapping with str keys; the reserved key is refused."""
    if not isinstance(payload, Mapping):
        raise WireError(
            f"{what} must be a mapping of name -> numpy array or JSON value, "
            f"got {type(payload).__name__}")
    for key in payload:
        if not isinstance(key, str):
            raise WireError(f"{what}: every key must be a str, got {key!r}")
        if key == META_KEY:
            raise WireError(f"{what}: key {META_KEY!r} is reserved for the transport; rename it")
    return payload


def deadline_after(timeout: float | None, default: float) -> float:
    """Monotonic deadline for ``timeout`` seconds (``None``: ``default``; inf allowed)."""
    if timeout is None:
        timeout = default
    if timeout < 0 or math.isnan(timeout):
        raise ValueError(f"timeout must be >= 0 seconds (or math.inf), got {timeout!r}")
    return time.monotonic() + timeout


def _remaining(deadline: float) -> float:
    return deadline - time.monotonic()


def _relay_size(message: Message) -> int:
    """Bytes a queued relay holds (its received frame's body; 0 if not known)."""
    return int(getattr(message.raw, "nbytes", 0) or 0)


@attrs.frozen
class Message:
    """One routed message inside a group (what a transport moves).

    ``meta`` is small JSON the transport itself uses (round numbers,
    weights, relay source); ``payload`` is the user's state. ``kind`` says
    whether bf16 on the wire may apply ("model") or not ("control").
    """

    src: int
    dst: int
    tag: int
    payload: Mapping[str, Any]
    meta: Mapping[str, Any] = attrs.Factory(dict)
    kind: str = "control"
    #: The transport's received frame, so a relay can forward it unchanged.
    raw: Any = attrs.field(default=None, eq=False, repr=False)
    #: ``time.monotonic()`` by which the whole write must be done, or None.
    #: A transport that can bound a write (see ``GroupBase.send_deadlines``)
    #: drops the link when it passes; others may ignore it.
    deadline: float | None = attrs.field(default=None, eq=False, repr=False)


class GroupBase:
    """Mailboxes, routing, the dead ledger and the reduce service for a transport.

    Subclasses implement ``_transmit`` and ``_drop_link`` (see the module
    docstring). ``links`` are the ranks this group has a direct connection to.
    """

    #: Whether ``_transmit`` honours ``Message.deadline`` (fails the write,
    #: and drops the link, once it passes). The reduce service then writes a
    #: single scatter on the calling thread; otherwise on a helper thread it
    #: can stop waiting for.
    send_deadlines = False

    def __init__(self, rank: int, world_size: int, *, timeout: float, is_star: bool,
                 bf16_wire: bool = False, address: str = "") -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = float(timeout)
        self.is_star = bool(is_star)
        self.bf16_wire = bool(bf16_wire)
        self._address = address
        self._cv = threading.Condition()
        self._inbox: dict[int, collections.deque[Message]] = collections.defaultdict(
            collections.deque)
        self._dead: dict[int, str] = {}
        self._joined: set[int] = set()
        self._links: set[int] = set()
        self._held: dict[int, collections.deque[Message]] = {}
        # Star coordinator: per-destination relay queues, their queued bytes and
        # the destinations with a writer thread, all under ``_relay_cv``.
        self._relay_cv = threading.Condition()
        self._relay_out: dict[int, collections.deque[Message]] = {}
        self._relay_bytes: dict[int, int] = {}
        self._relay_writers: set[int] = set()
        self._relay_sending: set[int] = set()
        self._closed = False
        self._round = 0
        #: Called with (rank, reason) after a rank is declared dead (observers).
        self.on_dead: Callable[[int, str], None] | None = None

    # -- to implement -------------------------------------------------------

    def _transmit(self, peer: int, message: Message, timeout: float | None) -> None:
        raise NotImplementedError

    def _drop_link(self, peer: int) -> None:
        raise NotImplementedError

    def _shutdown(self) -> None:
        """Release transport resources (sockets, threads) after close."""

    def _relay_now(self, peer: int, message: Message) -> bool:
        """Star coordinator: send a relayed ``message`` at once if that cannot wait.

        Called on the thread reading from the message's sender, which must not
        wait for a destination that stopped reading. Return True once sent,
        or False (nothing sent) to have it queued for ``peer``'s relay writer
        thread. The default always queues.
        """
        return False

    # -- properties ---------------------------------------------------------

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    @property
    def address(self) -> str:
        return self._address

    @property
    def dead(self) -> dict[int, str]:
        with self._cv:
            return dict(self._dead)

    @property
    def joined(self) -> list[int]:
        with self._cv:
            return sorted(self._joined)

    @property
    def live_ranks(self) -> list[int]:
        with self._cv:
            if self.is_coordinator:
                return sorted(r for r in self._joined if r not in self._dead)
            return sorted(r for r in self._links if r not in self._dead)

    @property
    def round(self) -> int:
        """How many reduce rounds this group has started."""
        return self._round

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} rank {self.rank}/{self.world_size} "
                f"{'star' if self.is_star else 'mesh'} {self.address}>")

    def __enter__(self) -> GroupBase:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- bookkeeping transports call ----------------------------------------

    def _joined_rank(self, rank: int) -> None:
        with self._cv:
            self._joined.add(rank)
            self._links.add(rank)
            held = self._held.pop(rank, ())
            self._cv.notify_all()
        for message in held:
            self._relay(message)

    def _add_link(self, rank: int) -> None:
        with self._cv:
            self._links.add(rank)
            self._cv.notify_all()

    def _link_lost(self, rank: int, reason: str, *, quiet: bool = False) -> None:
        """A link died under us (EOF, timeout, bad frame, or a clean leave)."""
        self.declare_dead(rank, reason, quiet=quiet)

    def declare_dead(self, rank: int, reason: str, *, quiet: bool = False) -> None:
        """Record ``rank`` as dead for the rest of this group's life and drop its link.

        ``quiet`` logs at INFO instead of WARNING (a rank that left on purpose).
        """
        with self._cv:
            if rank in self._dead or rank == self.rank:
                return
            self._dead[rank] = reason
            # Messages held for a rank that never joined can never be delivered.
            self._held.pop(rank, None)
            self._cv.notify_all()
        with self._relay_cv:
            # Nor can relays queued for it; readers waiting for room move on.
            self._relay_out.pop(rank, None)
            self._relay_bytes.pop(rank, None)
            self._relay_cv.notify_all()
        if not self._closed:
            log.log(logging.INFO if quiet else logging.WARNING,
                    "rank %d: declaring rank %d dead: %s", self.rank, rank, reason)
        try:
            self._drop_link(rank)
        except Exception:  # dropping a dead link is best effort
            log.debug("dropping link to rank %d failed", rank, exc_info=True)
        callback = self.on_dead
        if callback is not None:
            callback(rank, reason)

    def _deliver(self, message: Message) -> None:
        """A complete, authenticated message arrived: relay it or queue it."""
        # Only the coordinator may speak for the reduce service: a worker
        # forging a scatter (or a contribution aimed elsewhere) is dropped.
        if (message.tag == TAG_SCATTER and message.src != 0) or (
                message.tag == TAG_REDUCE and message.dst != 0) or message.tag == TAG_WELCOME:
            log.warning("rank %d dropped a reduce-service frame (tag 0x%X) from rank %d to "
                        "rank %d: only the coordinator runs the reduce service",
                        self.rank, message.tag, message.src, message.dst)
            return
        if message.dst != self.rank:
            self._relay(message)
            return
        with self._cv:
            if self._closed:
                return
            self._inbox[message.tag].append(message)
            self._cv.notify_all()

    def _relay(self, message: Message) -> None:
        # Only the star's coordinator relays; anything else is a routing bug or
        # a peer misbehaving, and is dropped loudly rather than bounced around.
        if not self.is_coordinator:
            log.warning("rank %d dropped a message for rank %d from rank %d: not a relay",
                        self.rank, message.dst, message.src)
            return
        with self._cv:
            if message.dst not in self._joined and message.dst not in self._dead:
                # Workers join in any order: hold a few messages for a rank that
                # has not joined yet instead of dropping them, deliver on join.
                held = self._held.setdefault(message.dst, collections.deque())
                if len(held) < _MAX_HELD:
                    held.append(message)
                    return
                log.warning("dropped a message from rank %d to rank %d: rank %d has not "
                            "joined and %d messages already wait for it", message.src,
                            message.dst, message.dst, _MAX_HELD)
                return
        self._queue_relay(message)

    def _queue_relay(self, message: Message) -> None:
        """Queue ``message`` for its destination's relay writer.

        Called on the reader thread of the rank that sent it. It returns at
        once unless that destination's queue is full; then it waits for room,
        which holds up only this sender. A queue that stays full for half the
        stall timeout means its destination takes nothing: that rank is
        declared dead (the sender and every other rank carry on).
        """
        dst = message.dst
        with self._relay_cv:
            # Nothing queued or being written for ``dst``: try writing it here.
            inline = not self._relay_out.get(dst) and dst not in self._relay_sending
            if inline:
                self._relay_sending.add(dst)
        if inline:
            try:
                if self._relay_now(dst, message):
                    return
            except (PeerLostError, WireError) as exc:
                log.warning("relaying a message from rank %d to rank %d failed: %s",
                            message.src, dst, exc)
                return
            finally:
                with self._relay_cv:
                    self._relay_sending.discard(dst)
                    self._relay_cv.notify_all()
        size = _relay_size(message)
        patience = self.timeout / 2
        deadline = time.monotonic() + patience
        start = False
        full = ""
        with self._relay_cv:
            while True:
                if self._closed or dst in self._dead:
                    return
                queue = self._relay_out.setdefault(dst, collections.deque())
                queued = self._relay_bytes.get(dst, 0)
                if not queue or (len(queue) < _RELAY_QUEUE
                                 and queued + size <= _RELAY_QUEUE_BYTES):
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    full = f"{len(queue)} message(s), {queued} bytes"
                    break
                self._relay_cv.wait(remaining)
            if not full:
                queue.append(message)
                self._relay_bytes[dst] = queued + size
                if dst not in self._relay_writers:
                    self._relay_writers.add(dst)
                    start = True
                self._relay_cv.notify_all()
        if full:
            self.declare_dead(dst, f"took none of the {full} relayed to it for {patience:g} s "
                                   f"(half the stall timeout); dropped as stalled")
            return
        if start:
            threading.Thread(target=self._relay_writer, args=(dst,), daemon=True,
                             name=f"meshkit-relay-r{self.rank}-to-{dst}").start()

    def _relay_writer(self, dst: int) -> None:
        """Send the messages queued for ``dst`` in order; end when idle or dead."""
        while True:
            with self._relay_cv:
                idle_until = time.monotonic() + _RELAY_IDLE
                while True:
                    queue = self._relay_out.get(dst)
                    if self._closed or queue is None:
                        break
                    if queue:
                        if dst not in self._relay_sending:
                            break
                        # A reader is writing one inline; it notifies when done.
                        self._relay_cv.wait(1.0)
                        continue
                    remaining = idle_until - time.monotonic()
                    if remaining <= 0:
                        break
                    self._relay_cv.wait(remaining)
                if not queue or self._closed:
                    self._relay_writers.discard(dst)
                    if queue is not None and not queue:
                        del self._relay_out[dst]
                        self._relay_bytes.pop(dst, None)
                    return
                message = queue.popleft()
                self._relay_bytes[dst] -= _relay_size(message)
                self._relay_sending.add(dst)
                self._relay_cv.notify_all()
            try:
                self._transmit(dst, message, None)
            except (PeerLostError, WireError) as exc:
                log.log(logging.DEBUG if self._closed else logging.WARNING,
                        "relaying a message from rank %d to rank %d failed: %s",
                        message.src, dst, exc)
            finally:
                with self._relay_cv:
                    self._relay_sending.discard(dst)
                    self._relay_cv.notify_all()

    # -- routing ------------------------------------------------------------

    def _check_rank(self, rank: Any, what: str) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"{what} must be a rank in 0..{self.world_size - 1}, got {rank!r}")
        return rank

    def _next_hop(self, dst: int) -> int:
        with self._cv:
            if self._closed:
                raise PeerLostError(f"rank {self.rank}: the group is closed")
            if dst in self._dead:
                raise PeerLostError(f"rank {dst} is dead: {self._dead[dst]}")
            if dst in self._links:
                return dst
            if self.is_star and not self.is_coordinator:
                if 0 in self._dead:
                    raise PeerLostError(
                        f"the coordinator (rank 0) is lost: {self._dead[0]}")
                return 0
            if self.is_coordinator:
                raise PeerLostError(
                    f"rank {dst} has not joined the mesh (joined: {sorted(self._joined)})")
            raise PeerLostError(f"rank {self.rank} has no connection to rank {dst}")

    def _send_message(self, message: Message, timeout: float | None = None) -> None:
        hop = self._next_hop(message.dst)
        self._transmit(hop, message, timeout)

    # -- public API ---------------------------------------------------------

    def send(self, dst: int, tag: int, payload: Mapping[str, Any]) -> None:
        """Send ``payload`` to rank ``dst`` under ``tag`` (see the module docstring)."""
        self._check_rank(dst, "dst")
        if dst == self.rank:
            raise ValueError(f"rank {self.rank} cannot send to itself")
        check_tag(tag)
        check_state(payload)
        self._send_message(Message(self.rank, dst, tag, payload))

    def recv(self, src: int | None, tag: int, timeout: float | None = None) -> Any:
        """Receive the next payload with ``tag`` from ``src`` (``ANY``: ``(src, state)``)."""
        if src is not None:
            self._check_rank(src, "src")
        elif not self.is_coordinator:
            raise ValueError("recv(ANY, tag) is only available on the coordinator (rank 0)")
        check_tag(tag, service=True)
        message = self._take(tag, None if src is None else {src}, timeout)
        if src is None:
            return message.src, message.payload
        return message.payload

    def _unreachable(self, src: int) -> str | None:
        """Why ``src`` can no longer send to us, or None. Caller holds the lock."""
        if src in self._dead:
            return f"rank {src} is dead: {self._dead[src]}"
        if self.is_star and not self.is_coordinator and 0 in self._dead:
            return f"the coordinator (rank 0) is lost: {self._dead[0]}"
        return None

    def _take(self, tag: int, sources: set[int] | None, timeout: float | None,
              what: str | None = None) -> Message:
        """Pop the first message with ``tag`` from one of ``sources`` (None: any)."""
        deadline = deadline_after(timeout, self.timeout)
        with self._cv:
            while True:
                queue = self._inbox.get(tag)
                if queue:
                    for i, message in enumerate(queue):
                        if sources is None or message.src in sources:
                            del queue[i]
                            return message
                if self._closed:
                    raise PeerLostError(f"rank {self.rank}: the group was closed while waiting")
                label = what or f"a message with tag 0x{tag:X}"
                if sources is not None:
                    reasons = [self._unreachable(s) for s in sources]
                    if all(reasons):
                        raise PeerLostError(f"waiting for {label}: {'; '.join(reasons)}")
                elif self.world_size > 1 and len(self._dead) >= self.world_size - 1:
                    raise PeerLostError(
                        f"waiting for {label} from any rank: every other rank is dead "
                        f"({self._describe_dead()})")
                remaining = _remaining(deadline)
                if remaining <= 0:
                    who = "any rank" if sources is None else "rank " + ", ".join(
                        str(s) for s in sorted(sources))
                    raise PeerLostError(
                        f"rank {self.rank}: waiting for {label} from {who}: nothing arrived within "
                        f"{self._fmt_timeout(timeout)}; the peer stalled or is gone "
                        f"(raise the timeout if it is just slow)")
                self._cv.wait(min(remaining, 3600.0))

    def _fmt_timeout(self, timeout: float | None) -> str:
        return f"{self.timeout if timeout is None else timeout:g} s"

    def _describe_dead(self) -> str:
        return "; ".join(f"rank {r}: {why}" for r, why in sorted(self._dead.items())) or "none"

    def wait_for_workers(self, timeout: float | None = None) -> list[int]:
        """Coordinator: block until every worker has joined (or is dead)."""
        if not self.is_coordinator:
            raise MeshError("wait_for_workers() is for the coordinator (rank 0)")
        deadline = deadline_after(timeout, self.timeout)
        expected = set(range(1, self.world_size))
        with self._cv:
            while True:
                missing = expected - self._joined - set(self._dead)
                if not missing:
                    return sorted(self._joined)
                if self._closed:
                    raise PeerLostError("the group was closed while waiting for workers")
                remaining = _remaining(deadline)
                if remaining <= 0:
                    raise PeerLostError(
                        f"waited {self._fmt_timeout(timeout)} for {self.world_size - 1} "
                        f"worker(s); rank(s) {sorted(missing)} never joined (joined: "
                        f"{sorted(self._joined)}); check their peers/secret/world, or "
                        f"raise the timeout")
                self._cv.wait(min(remaining, 3600.0))

    def all_reduce(self, state: Mapping[str, Any], weight: float = 1.0,
                   timeout: float | None = None, *, kind: str = "model") -> dict[str, Any]:
        """Worker: contribute to the coordinator's reduce round and return its scatter."""
        from meshkit.transport import reduce

        return reduce.contribute(self, state, weight, timeout, kind=kind)

    def reduce_round(self, aggregator: Any, outer: Any = None, global_state: Any = None,
                     timeout: float | None = None, *, contribution: Any = None,
                     weight: float = 1.0, kind: str = "model") -> RoundResult:
        """Coordinator: run one round of the star reduce service."""
        from meshkit.transport import reduce

        return reduce.run_round(self, aggregator, outer, global_state, timeout,
                                contribution=contribution, weight=weight, kind=kind)

    def close(self) -> None:
        """Leave the mesh; peers see this rank's links as lost. Idempotent."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        with self._relay_cv:
            self._relay_out.clear()
            self._relay_bytes.clear()
            self._relay_cv.notify_all()
        self._shutdown()
