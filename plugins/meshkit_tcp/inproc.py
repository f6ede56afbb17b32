"""The ``inproc`` transport: every rank a thread of one process.

Ranks meet at a *hub* named by ``NodeConfig.peers[0]`` (e.g.
``"inproc://job-1"``). As with ``tcp``, one peer entry means a star; a mesh
repeats the hub name once per rank (``peers=["inproc://job-1"] * world``,
``topology="mesh"``) and ``connect`` then waits until every rank is there.
Same Group API, same routing (a star's workers reach each other through the
coordinator), same dead ledger and reduce service as ``tcp``; payloads are
validated and copied exactly as the wire would, so a test that passes here
exercises everything above the socket. The secret is required and compared
like the handshake would, so tests do not silently skip the refusal paths.

It is also the smallest complete example of the transport contract:
:class:`InprocLinks` implements :class:`meshkit.transport.Links` and
``connect`` wraps it in a plain :class:`meshkit.transport.Group`.
"""

from __future__ import annotations

import hmac
import threading
from typing import Any


from meshkit.errors import AuthenticationError, ConfigError, PeerLostError, WireError
from meshkit.node.config import NodeConfig
from meshkit.state import copy_state, validate_state
from meshkit.transport import Group, LinkEvents, Links, Message

__all__ = ["InprocTransport", "InprocLinks"]

_hubs: dict[str, _Hub] = {}
_hubs_lock = threading.Lock()


class _Hub:
    def __init__(self, name: str, world: int, secret: bytes) -> None:
        self.name = name
        self.world = world
        self.secret = secret
        self.links: dict[int, InprocLinks] = {}
        self.cv = threading.Condition(_hubs_lock)


def _is_star(config: NodeConfig) -> bool:
    # Same rule as tcp: one peer entry is a star; a mesh lists the hub name
    # once per rank (peers=["inproc://x"] * world) with topology="mesh".
    return config.is_star


class InprocLinks(Links):
    """One rank's links at an in-process hub: a send is a copy into the peer's mailbox."""

    # A send is a copy into the peer's mailbox: it never waits on the peer.
    send_deadlines = True

    def __init__(self, hub: _Hub, rank: int) -> None:
        self._hub = hub
        self.rank = rank
        self._address = f"inproc://{hub.name}" if "://" not in hub.name else hub.name
        #: Ranks this one is linked to (under the hub lock).
        self._peers: set[int] = set()
        self.events: LinkEvents | None = None

    @property
    def address(self) -> str:
        return self._address

    def attach(self, events: LinkEvents) -> None:
        self.events = events

    def _peer(self, rank: int) -> InprocLinks | None:
        with _hubs_lock:
            return self._hub.links.get(rank)

    def transmit(self, peer: int, message: Message, timeout: float | None) -> None:
        target = self._peer(peer)
        if target is None or target.events is None or target.events.closed:
            raise PeerLostError(f"rank {peer} is not connected to {self._hub.name}")
        assert self.events is not None
        why = self.events.dead_reason(peer)
        if why is not None:
            raise PeerLostError(f"rank {peer} is dead: {why}")
        # Copy and validate exactly as encoding a frame would: the receiver must
        # never share arrays with the sender.
        validate_state(message.payload, where=f"frame to rank {message.dst}",
                       allow_nonfinite=True, error=WireError)
        payload = copy_state(message.payload)
        target.events.deliver(Message(message.src, message.dst, message.tag, payload,
                                      dict(message.meta), message.kind))

    def relay_now(self, peer: int, message: Message) -> bool:
        # A copy into a mailbox never waits on the peer: relay on the spot.
        self.transmit(peer, message, None)
        return True

    def drop(self, peer: int) -> None:
        target = self._peer(peer)
        if target is not None and target.events is not None:
            target.events.lost(self.rank, f"rank {self.rank} dropped the connection")

    def close(self) -> None:
        with _hubs_lock:
            if self._hub.links.get(self.rank) is self:
                del self._hub.links[self.rank]
            peers = [links for r, links in self._hub.links.items() if r in self._peers]
            if not self._hub.links and _hubs.get(self._hub.name) is self._hub:
                del _hubs[self._hub.name]
            self._hub.cv.notify_all()
        for peer in peers:
            if peer.events is not None:
                peer.events.lost(self.rank, "closed its connection (left the mesh)", quiet=True)

    def link(self, peer: InprocLinks) -> None:
        """Link this rank and ``peer`` both ways."""
        with _hubs_lock:
            self._peers.add(peer.rank)
            peer._peers.add(self.rank)
        for one, other in ((self, peer), (peer, self)):
            assert one.events is not None
            # In a mesh the coordinator still runs the reduce service, so every
            # rank linked to rank 0 counts as joined there (the kernel's rule).
            one.events.linked(other.rank)


class InprocTransport:
    """Factory result of the ``inproc`` component: ``connect(node_config) -> Group``."""

    def __init__(self, options: Any = None) -> None:
        self.options = options

    def connect(self, config: NodeConfig) -> Group:
        if not config.peers:
            raise ConfigError(
                "the inproc transport needs a hub name: set peers to one name shared by "
                "every rank, e.g. peers=['inproc://job-1']")
        if not config.secret:
            raise ConfigError(
                "no secret: every transport refuses to connect without one; set "
                "NodeConfig.secret (MESHKIT_SECRET or secret_file)")
        name = config.peers[0]
        with _hubs_lock:
            hub = _hubs.get(name)
            if hub is None:
                hub = _hubs[name] = _Hub(name, config.world, config.secret)
            self._check(hub, config)
            links = InprocLinks(hub, config.rank)
            group = Group(links, rank=config.rank, world_size=config.world,
                          timeout=config.timeout, is_star=_is_star(config))
            hub.links[config.rank] = links
            hub.cv.notify_all()
        try:
            self._link(hub, links, config)
        except BaseException:
            group.close()
            raise
        return group

    @staticmethod
    def _check(hub: _Hub, config: NodeConfig) -> None:
        # The same refusals, in the same order, as the tcp handshake.
        if not hmac.compare_digest(hub.secret, config.secret or b""):
            raise AuthenticationError(
                f"rank {config.rank}: authentication with {hub.name} failed (wrong secret?)")
        if hub.world != config.world:
            raise WireError(
                f"rank {config.rank}: world size mismatch: this rank was configured for a "
                f"world of {config.world}, the mesh at {hub.name} has {hub.world}; give "
                f"every rank the same world")
        if config.rank in hub.links:
            raise WireError(
                f"rank {config.rank} is already connected to {hub.name} (duplicate rank): "
                f"give each node a distinct rank in 1..{hub.world - 1}")
        coordinator = hub.links.get(0)
        why = None
        if coordinator is not None and coordinator.events is not None:
            why = coordinator.events.dead_reason(config.rank)
        if why is not None:
            raise WireError(
                f"rank {config.rank} was declared dead by the coordinator "
                f"({why}); a dead rank cannot rejoin this run")

    @staticmethod
    def _link(hub: _Hub, links: InprocLinks, config: NodeConfig) -> None:
        star = _is_star(config)
        needed = {0} if star and config.rank != 0 else (
            set() if star else set(range(config.world)) - {config.rank})
        with _hubs_lock:
            if not hub.cv.wait_for(lambda: needed <= set(hub.links), config.timeout):
                missing = sorted(needed - set(hub.links))
                raise PeerLostError(
                    f"rank {config.rank}: rank(s) {missing} did not appear at {hub.name} "
                    f"within {config.timeout:g} s")
            peers = [hub.links[r] for r in needed]
        for peer in peers:
            links.link(peer)
