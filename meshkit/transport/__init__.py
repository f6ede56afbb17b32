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
    (:mod:`meshkit.transport.tags` lists every one), and the transport's own
    tags are refused. In a star, worker-to-worker sends are
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
    The dead-rank ledger: rank -> why it was declared dead. A death stands
    until the rounds take the rank back (a restarted node, ``returning`` /
    ``take_back()``, only between rounds). ``declare_dead(rank, reason)`` adds
    to it (e.g. a strategy's own liveness check) and drops the rank's link.
    Who is in, who is dead and who is taken back is decided in one place,
    :class:`Membership` (``_membership.py``).

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
tries to rejoin. Routing (star forwarding), mailboxes, timeouts, the dead
ledger and the ring all-reduce then come for free. ``docs/transports.md`` walks
through a complete example.

Where each idea lives: ``tags.py`` (every reserved tag), ``_message.py``
(:class:`Message`, the payload rules), ``_contract.py`` (:class:`Links`,
:class:`LinkEvents`), ``_group.py`` (:class:`Group`: the API and routing),
``_collective.py`` (the mesh all-reduce), ``_membership.py`` (who is in, who
is dead and why, who is taken back: the one place any of it changes),
``_ledger.py`` (routing over it: links, held messages, the next hop),
``_mailbox.py`` (received messages until a ``recv`` takes them),
``_forwarding.py`` (the star's per-destination queues and writers),
``_timeouts.py`` (timeouts as deadlines), ``_traits.py`` (what a transport
declares, :class:`TransportTraits`, and the trust rule for one that
authenticates nothing: :func:`trust_refusal`). The star reduce service
(``all_reduce`` / ``reduce_round``) was removed in issue 21: every round
runs on the one round engine (``meshkit.train.fold_round``). UDP discovery is the
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
from meshkit.transport._timeouts import deadline_after
from meshkit.transport_traits import TransportTraits, is_loopback, transport_traits, trust_refusal
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
    "check_state",
    "deadline_after",
    "describe_dead",
    "TransportTraits",
    "transport_traits",
    "trust_refusal",
    "is_loopback",
    "Membership",
    "MAX_UNREAD_BYTES",
    "MAX_UNREAD_TAGS",
]
