"""The ``tcp`` transport: a star or a full mesh of authenticated TCP channels.

Star (``peers`` = one address, or ``topology = "star"``): the coordinator
(rank 0) listens at ``NodeConfig.bind`` (or the peer address); workers dial
it and nothing dials them, which is what a phone behind NAT can do. A
worker-to-worker ``send`` is relayed by the coordinator, which forwards the
authenticated body unchanged.

Mesh (``peers`` = ``world`` addresses): rank ``i`` listens at ``peers[i]``,
dials every lower rank and accepts every higher one, so every pair has one
connection. ``connect`` returns once all ``world - 1`` links are up.

Every connection runs :func:`meshkit.wire.handshake` (secret-derived keys,
protocol version, world size), then the accepting side checks the claimed
rank (range, expected, not a duplicate of a live rank; in a mesh, not
declared dead: a star's coordinator lets a dead rank's restarted node in,
and the ledger keeps it *returning* until the rounds take it back)
and answers with a welcome frame or a refusal the dialer raises as a
:class:`~meshkit.WireError` naming what differed. A refused or failed
connection never takes the accept loop down: it is logged and counted in
``group.refused``, and the ranks that behave carry on.

Each link has one reader thread that waits for a frame to start without a
timeout (a worker may train for a long time between frames) and then reads
it under the channel's stall timeout: a peer that stops mid-frame, sends
garbage, or fails authentication is dropped and declared dead. A reader
hands the channel the placers registered for its peer
(:meth:`TcpLinks.receive_into`: the mesh all-reduce's ring), so an expected
segment's body lands straight in the ring's buffer.

Host relays (``meshkit relay``, :mod:`meshkit_tcp.relay`): a star's
coordinator also accepts a relay's connection (handshake role ``relay``),
which announces the ranks it carries. Each carried rank that joins the
relay joins the coordinator over that one connection (``group.relays``
lists them); frames to it carry their destination, deaths the coordinator
declares are forwarded to the relay, and a relay connection that is lost
takes exactly its ranks with it.

How it composes (docs/transports.md, "Writing a transport"):
:class:`TcpLinks` implements :class:`meshkit.transport.Links` and owns every
socket, channel and thread above; :class:`TcpGroup` is a plain
:class:`meshkit.transport.Group` wrapped around it that only shows the links'
counters (``refused``, ``bytes_in``, ...), as ``inproc`` wraps
``InprocLinks``.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs

from meshkit import wire
from meshkit.errors import ConfigError
from meshkit.node.config import NodeConfig
from meshkit.transport import Group, HostRelay
from meshkit.transport.discovery import DiscoveryServer, resolve

from meshkit_tcp import TcpOptions
from meshkit_tcp.links import TcpLinks
from meshkit_tcp.sockets import MAX_HANDSHAKES, parse_address

__all__ = ["TcpTransport", "TcpLinks", "TcpGroup", "parse_address", "MAX_HANDSHAKES"]

log = logging.getLogger(__name__)


class TcpGroup(Group):
    """One rank's handle on a TCP star or mesh: a :class:`meshkit.transport.Group` over :class:`TcpLinks`.

    Everything it does is the kernel's; it only shows what its links count
    (``refused``, ``bytes_in``, ``bytes_out``, ``relay_bytes_in``,
    ``discovery_port``), read-only.
    """

    def __init__(self, links: TcpLinks, *, max_unread: int) -> None:
        super().__init__(links, rank=links.rank, world_size=links.world_size,
                         timeout=links.timeout, is_star=links.is_star, max_unread=max_unread)
        self._tcp = links

    @property
    def links(self) -> TcpLinks:
        """This group's TCP links (their sockets and counters; for diagnostics and tests)."""
        return self._tcp

    @property
    def refused(self) -> list[str]:
        """Connections refused or failed at the handshake (the newest 256, newest last)."""
        return self._tcp.refused

    @property
    def bytes_in(self) -> int:
        """Frame body bytes this rank received."""
        return self._tcp.bytes_in

    @property
    def bytes_out(self) -> int:
        """Frame body bytes this rank sent."""
        return self._tcp.bytes_out

    @property
    def relay_bytes_in(self) -> dict[str, int]:
        """Coordinator: body bytes each connected host relay sent up, by name (its ranks'
        frames and its own answers); a part of ``bytes_in``."""
        return self._tcp.relay_bytes_in

    @property
    def discovery_port(self) -> int | None:
        """The UDP port of this rank's discovery responder, or None without one."""
        discovery = self._tcp.discovery
        return None if discovery is None else discovery.port


class TcpTransport:
    """Factory result of the ``tcp`` component: ``connect(node_config) -> Group``."""

    def __init__(self, options: TcpOptions | None = None, *,
                 benchmark_only_disable_mac: bool = False, relay_factory: Any = None) -> None:
        self.options = options if options is not None else TcpOptions()
        # Never reachable from config: only benchmarks/allreduce.py builds a
        # transport this way, on every rank, to measure what the MAC costs.
        self._benchmark_only_disable_mac = benchmark_only_disable_mac
        # meshkit_tcp.relay's start_relay (the component factory passes it in:
        # the relay builds on this module, so this module cannot import it).
        self._relay_factory = relay_factory

    def start_relay(self, **settings: Any) -> HostRelay:
        """Start a host relay (``meshkit relay``); ``settings`` are ``RelayConfig``'s fields.

        Returns the running :class:`meshkit_tcp.relay.HostRelay` (its
        ``address``, ``serve()``, ``close()``).
        """
        if self._relay_factory is None:
            raise ConfigError("this tcp transport was built without host relay support; "
                              "create it with meshkit.plugins.create('transport', 'tcp')")
        return self._relay_factory(self.options, **settings)

    def connect(self, config: NodeConfig) -> TcpGroup:
        if not config.secret:
            raise ConfigError(
                "no secret: every meshkit connection is authenticated with a shared secret; "
                "set secret_file in [mesh] or MESHKIT_SECRET (the same on every node)")
        if len(config.secret) < wire.MIN_SECRET:
            raise ConfigError(
                f"the shared secret is {len(config.secret)} bytes; use at least "
                f"{wire.MIN_SECRET} random bytes (e.g. `openssl rand -hex 32 > secret`)")
        secret: bytes = config.secret
        server = None
        # A star's coordinator listens first and then announces the port it
        # actually bound (bind may be port 0); everyone else resolves first.
        announce = config.discover and not config.peers and config.rank == 0 and config.is_star
        if announce:
            config = attrs.evolve(config, bind=config.bind or f"0.0.0.0:{config.data_base}")
        elif config.discover and not config.peers:
            config, server = resolve(config)
        try:
            max_unread = int(self.options.max_unread_bytes)
            if not 0 < max_unread < 1 << 63:
                raise ConfigError(f"[transport] max_unread_bytes must be a positive byte count "
                                  f"below 2**63, got {max_unread}")
            links = TcpLinks(config, self.options,
                             benchmark_only_disable_mac=self._benchmark_only_disable_mac)
            group = TcpGroup(links, max_unread=max_unread)
        except BaseException:
            if server is not None:
                server.close()
            raise
        links.discovery = server
        if server is not None:
            server.linked = links.has_link
        try:
            links.start()
            if announce:
                port = int(links.address.rpartition(":")[2])
                links.discovery = DiscoveryServer(secret, config.world, data_port=port,
                                                  port=config.disc_port, topology="star",
                                                  linked=links.has_link)
                log.info("rank 0: discovery responder on UDP port %d announces TCP port %d",
                         links.discovery.port, port)
        except BaseException:
            group.close()
            raise
        return group
