"""The Group API, the contract a transport implements, and the machinery they share.

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
    :data:`RESERVED_TAGS` (``0xFFFF0000``) belong to the kernel
    (:mod:`meshkit.transport.tags` lists every one), and the reduce
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
    One round of the star reduce service (``_reduce.py`` documents it): every
    live worker's contribution is folded as it arrives into
    ``aggregator.begin()`` (a streaming aggregator; wrap one that only has
    ``aggregate()`` in ``meshkit.aggregation.streaming(aggregator)``, which
    buffers the round); workers that die, stall past
    ``timeout`` or fail authentication are declared dead and their
    contributions discarded; ``outer.step(global_state, consensus)`` runs when
    ``outer`` is given; one state is scattered to every surviving
    contributor. ``contribution``/``weight`` let the coordinator fold its own
    state too. When no contribution at all can be accepted (every worker
    dead) it raises :class:`~meshkit.PeerLostError` quoting the dead ledger:
    the service ends cleanly, it never invents a consensus.

``mesh_all_reduce(state, weight=1.0, *, ranks=None, timeout=None) -> State`` (any rank)
    Every rank in ``ranks`` (default: all) calls it; each gets the weighted
    mean ``sum w_i x_i / sum w_i`` of their floating arrays, each in its own
    dtype, with no fold on the coordinator: the transport's own collective
    when it offers one (:meth:`Links.all_reduce_sum`; ``torchdist``), else a
    ring reduce-scatter + all-gather over the direct links (a mesh; refused
    in a star). A participant lost or stalled past ``timeout`` (per step) is
    :class:`~meshkit.PeerLostError` on *every* participant; keys, shapes or
    dtypes that differ between ranks, an integer array or a JSON value are
    :class:`~meshkit.AggregationError`. ``_collective.py`` has the rule.

Unread messages (``_mailbox.py``)
    Messages wait in this rank's mailbox until a ``recv`` takes them, at most
    ``max_unread`` bytes (:data:`MAX_UNREAD_BYTES`, 64 MiB; ``Group(...,
    max_unread=N)``, tcp's ``[transport] max_unread_bytes``) per (source,
    tag) behind the oldest unread one, which may be any size the transport
    accepts, and on at most :data:`MAX_UNREAD_TAGS` tags per source. A sender
    past either is in breach: its unread messages are discarded and it is
    declared dead, named with the bound.

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

Implement :class:`Links` (this rank's direct links: ``attach``,
``transmit``, ``drop``; optionally ``relay_now``, ``all_reduce_sum``, ``close``,
``address``, ``send_deadlines``), wrap it in ``Group(links, rank=..., world_size=...,
timeout=..., is_star=...)`` and return the group from ``connect``. Report
what happens on the links through the :class:`LinkEvents` the group hands
to ``Links.attach``: ``deliver(message)`` for each complete, authenticated
message, ``linked(peer)`` when a link's handshake completes, ``lost(peer,
reason)`` when a link dies, ``dead_reason(peer)`` to refuse a dead rank that
tries to rejoin. Routing (star relay), mailboxes, timeouts, the dead ledger
and the reduce service then come for free. ``docs/transports.md`` walks
through a complete example.

Where each idea lives: ``tags.py`` (every reserved tag), ``_message.py``
(:class:`Message`, the payload rules), ``_contract.py`` (:class:`Links`,
:class:`LinkEvents`), ``_group.py`` (:class:`Group`: the API and routing),
``_collective.py`` (the mesh all-reduce), ``_ledger.py`` (joined ranks, links, the dead ledger), ``_mailbox.py``
(received messages until a ``recv`` takes them), ``_relay.py`` (the star
relay's per-destination queues and writers), ``_reduce.py`` (the reduce
service), ``_timeouts.py`` (timeouts as deadlines). UDP discovery is the
public module :mod:`meshkit.transport.discovery` (``DiscoveryServer``,
``discover``, ``resolve``), imported on its own because it loads the wire
codec, which ``import meshkit.transport`` does not need.
"""

from __future__ import annotations

from meshkit.transport import tags
from meshkit.transport._contract import HostRelay, LinkEvents, Links, OffersHostRelays
from meshkit.transport._group import ANY, Group
from meshkit.transport._membership import Membership, describe_dead
from meshkit.transport._mailbox import MAX_UNREAD_BYTES, MAX_UNREAD_TAGS
from meshkit.transport._message import KINDS, META_KEY, Message, check_state
from meshkit.transport._reduce import MIN_SCATTER_BYTES_PER_SECOND, RoundResult
from meshkit.transport._timeouts import deadline_after
# Every tag, as tags.__all__ lists them (the module is the one place they live).
from meshkit.transport.tags import *  # noqa: F403

__all__ = [
    "ANY",
    "tags",
    *tags.__all__,
    "META_KEY",
    "KINDS",
    "Message",
    "Group",
    "Links",
    "LinkEvents",
    "HostRelay",
    "OffersHostRelays",
    "RoundResult",
    "MIN_SCATTER_BYTES_PER_SECOND",
    "check_state",
    "deadline_after",
    "describe_dead",
    "Membership",
    "MAX_UNREAD_BYTES",
    "MAX_UNREAD_TAGS",
]
