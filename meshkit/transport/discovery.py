"""UDP discovery: finding the coordinator (star) or every peer (mesh) without a peers list.

The coordinator (rank 0) runs a :class:`DiscoveryServer` on ``disc_port``.
Every other rank sends a *hello* datagram, broadcast on the LAN
(``<broadcast>:disc_port``) or unicast to a rendezvous host (``via``) on
networks without broadcast (carrier and guest Wi-Fi, containers, phones).
The server records ``rank -> source address : data port`` and answers with
the table of ranks it knows; a worker of a star stops once it knows rank 0,
a mesh rank once it knows all ``world`` ranks. Rank ``r`` listens for TCP on
``data_base + r``.

Every datagram is sealed with :func:`meshkit.wire.seal_datagram` (HMAC-SHA256
under a key derived from the shared secret), carries a JSON body, and
answers echo the asker's random nonce, so a reply cannot be replayed to
another asker. Hellos are fresh too: the server draws a random *session* when
it starts and registers only hellos that carry it. A hello without it (or
with another run's) gets a small sealed *challenge* naming the session, and
the asker says hello again with it, so a hello captured in an earlier run
with the same secret is answered with a challenge and registers nothing.
Once a rank is registered, its hello repeated from another host is ignored,
so a replay inside the run can neither move the rank nor draw the table to
a spoofed address. Datagrams that fail authentication, do not parse, or carry
the wrong fields are ignored and counted (``server.ignored``,
``DiscoveryResult.ignored``): on a shared LAN foreign traffic is normal and
must not stop anything. A second node claiming a rank that another node
holds is refused with a message naming the rank; a world size that differs
is refused naming both sizes. Both refusals reach the asker, which raises
:class:`~meshkit.WireError`.

**Rejoining.** A node restarted with its rank says hello with a new nonce.
The server asks the transport whether the rank has a link right now
(``linked``, set by the group that owns the server): while it does, the
new hello is a second node claiming a live rank and is refused as above;
once the old link is gone (the node died, so the coordinator dropped it),
the rank is registered again at the hello's address and answered with the
table, exactly as ``--peers`` lets a restarted node back in. Discovery
authenticates nothing beyond the shared secret and only says where to
dial: the rejoining node is authenticated by the TCP handshake (and, with
``authorized_nodes``, by its node key bound to that rank), so a holder of
the secret cannot take a live rank, nor a dead one without its key.

Datagram body (UTF-8 JSON, inside the sealed envelope):

* hello: ``{"v": 2, "t": "hello", "rank": r, "world": w, "port": p, "nonce": hex,
  "session": hex}`` (``session`` absent until the server named it)
* challenge: ``{"v": 2, "t": "challenge", "nonce": hex, "session": hex}``
* table: ``{"v": 2, "t": "table", "nonce": hex, "world": w, "peers": {"0": "host:port", ...},
  "topology": "star" | "mesh"}`` (an empty host means "the address this reply came
  from"; ``topology``, when present, is the coordinator's: a node that asked as
  a mesh rank joins a star coordinator as a star worker)

Every step is logged (``-v`` on the command line shows them), and a node that
gives up says what it tried: where it sent hellos, how many, for how long,
and what (if anything) answered.
* refused: ``{"v": 2, "t": "refused", "nonce": hex, "error": "..."}``
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Any, Callable

import attrs

from meshkit import wire
from meshkit.errors import ConfigError, MeshError, PeerLostError, WireError

__all__ = ["DiscoveryServer", "DiscoveryResult", "discover", "resolve", "VERSION"]

log = logging.getLogger(__name__)

VERSION = 2
#: Largest datagram we read (the sealed envelope of a table for a big world fits).
_MAX_DATAGRAM = 65_535
_RETRY = 0.2
_MAX_WORLD = 1 << 16


def _encode(secret: bytes, body: dict[str, Any]) -> bytes:
    return wire.seal_datagram(secret, json.dumps(body, separators=(",", ":")).encode())


def _decode(secret: bytes, datagram: bytes) -> dict[str, Any] | None:
    """The JSON body of a sealed datagram, or None for anything foreign or malformed."""
    try:
        payload = wire.open_datagram(secret, datagram)
        body = json.loads(payload.decode("utf-8"))
    except (MeshError, ValueError, RecursionError):  # RecursionError: deeply nested JSON
        return None
    if not isinstance(body, dict) or body.get("v") != VERSION or not isinstance(body.get("t"), str):
        return None
    return body


def _is_int(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


class DiscoveryServer:
    """Rank 0's discovery responder: a thread answering hellos on a UDP port."""

    def __init__(self, secret: bytes, world: int, *, data_port: int, host: str = "0.0.0.0",
                 port: int = 29600, topology: str | None = None,
                 linked: Callable[[int], bool] | None = None) -> None:
        if not secret:
            raise ConfigError("discovery needs the shared secret (datagrams are authenticated)")
        self.secret = bytes(secret)
        self.world = world
        #: Announced in every table (None: not announced).
        self.topology = topology
        #: This run's session: a hello must carry it to be registered.
        self.session = os.urandom(16).hex()
        #: Datagrams ignored: foreign, forged, malformed, from the wrong run,
        #: or a registered hello repeated from another host.
        self.ignored = 0
        #: Hellos refused (duplicate rank, world size), newest last.
        self.refused: list[str] = []
        #: Whether a rank has a link to this node right now (the transport's
        #: answer); a registered rank without one may register again (a
        #: restarted node). None: every registered rank is held for the run.
        self.linked = linked
        # rank -> (host, port, nonce); rank 0 is this node (host "" = our address).
        self._table: dict[int, tuple[str, int, str]] = {0: ("", data_port, "")}
        self._cv = threading.Condition()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
        except OSError as exc:
            self._sock.close()
            raise ConfigError(f"discovery cannot listen on UDP {host}:{port}: {exc}") from None
        self._sock.settimeout(_RETRY)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="meshkit-discovery",
                                        daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._sock.getsockname()[1]

    def table(self) -> dict[int, str]:
        """``rank -> host:port`` known so far (rank 0's host empty: this node)."""
        with self._cv:
            return {r: f"{h}:{p}" for r, (h, p, _) in sorted(self._table.items())}

    def wait_complete(self, timeout: float) -> dict[int, str]:
        """Block until every rank said hello; PeerLostError naming the missing ones."""
        with self._cv:
            if not self._cv.wait_for(lambda: len(self._table) >= self.world, timeout):
                missing = sorted(set(range(self.world)) - set(self._table))
                raise PeerLostError(
                    f"discovery: rank(s) {missing} did not announce themselves within "
                    f"{timeout:g} s on UDP port {self.port}")
        return self.table()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2 * _RETRY + 1)
        self._sock.close()

    def __enter__(self) -> DiscoveryServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                datagram, source = self._sock.recvfrom(_MAX_DATAGRAM)
            except socket.timeout:
                continue
            except OSError:
                if not self._stop.is_set():
                    log.warning("discovery: the UDP socket failed", exc_info=True)
                return
            reply = self._answer(datagram, source[0])
            if reply is not None:
                try:
                    self._sock.sendto(self._seal(reply), source)
                except OSError as exc:
                    log.debug("discovery: could not answer %s: %s", source, exc)

    def _seal(self, reply: dict[str, Any]) -> bytes:
        try:
            return _encode(self.secret, reply)
        except WireError:
            # A table of a few thousand ranks no longer fits in one datagram.
            # Rank 0 is all a star worker needs; a mesh rank that needs every
            # address keeps asking and times out naming the ranks it found.
            log.warning("discovery: the table of %d ranks does not fit in one datagram; "
                        "answering with rank 0 only (a mesh this large needs a peers list)",
                        len(reply.get("peers", ())))
            return _encode(self.secret, {**reply, "peers": {"0": reply["peers"]["0"]}})

    def _answer(self, datagram: bytes, host: str) -> dict[str, Any] | None:
        body = _decode(self.secret, datagram)
        if body is None or body["t"] != "hello" or not (
                _is_int(body.get("rank"), 1, _MAX_WORLD) and _is_int(body.get("world"), 1, _MAX_WORLD)
                and _is_int(body.get("port"), 1, 65535) and isinstance(body.get("nonce"), str)
                and len(body["nonce"]) <= 64 and isinstance(body.get("session", ""), str)):
            with self._cv:
                self.ignored += 1
            return None
        rank, nonce = body["rank"], body["nonce"]
        if body.get("session") != self.session:
            # Not (yet) of this run: name the session, register nothing. The
            # challenge is no bigger than the hello, so answering a spoofed
            # source amplifies nothing.
            return {"v": VERSION, "t": "challenge", "nonce": nonce, "session": self.session}
        error = None
        # Asked outside our lock: the transport takes its own.
        live = self.linked is None or rank == 0 or self.linked(rank)
        with self._cv:
            known = self._table.get(rank)
            if known is not None and known[2] == nonce and known[0] != host:
                # This run's hello for a registered rank, from another host: a
                # replay. Answering would send the table to a spoofed address.
                self.ignored += 1
                return None
            if body["world"] != self.world:
                error = (f"world size mismatch: rank {rank} announced a world of "
                         f"{body['world']}, the coordinator runs a world of {self.world}")
            elif rank >= self.world:
                error = f"rank {rank} is out of range for a world of {self.world}"
            else:
                if known is not None and known[2] != nonce and live:
                    error = (f"rank {rank} is already held by the node at {known[0]}:{known[1]} "
                             f"(duplicate rank); give each node a distinct rank")
                elif known is not None and known[2] != nonce:
                    log.info("discovery: rank %d said hello again from %s with a new nonce and "
                             "has no link: a restarted node, registered again", rank, host)
                    self._table[rank] = (host, body["port"], nonce)
                    self._cv.notify_all()
                elif known is None:
                    self._table[rank] = (host, body["port"], nonce)
                    self._cv.notify_all()
            if error is not None:
                self.refused.append(error)
                log.warning("discovery: refused a hello from %s: %s", host, error)
                return {"v": VERSION, "t": "refused", "nonce": nonce, "error": error}
            peers = {str(r): f"{h}:{p}" for r, (h, p, _) in self._table.items()}
        log.info("discovery: rank %d said hello from %s; answering with the table of %d rank(s)",
                 rank, host, len(peers))
        table = {"v": VERSION, "t": "table", "nonce": nonce, "world": self.world, "peers": peers}
        if self.topology is not None:
            table["topology"] = self.topology
        return table


@attrs.frozen
class DiscoveryResult:
    """What :func:`discover` found: ``peers`` (rank -> host:port), datagrams ignored,
    and the coordinator's topology when it announced one."""

    peers: dict[int, str]
    ignored: int
    topology: str | None = None


def discover(secret: bytes, *, rank: int, world: int, data_port: int, disc_port: int = 29600,
             via: str | None = None, want_all: bool = False,
             timeout: float = 30.0) -> DiscoveryResult:
    """Announce ``rank`` and ask the coordinator for addresses until satisfied.

    Broadcasts on ``disc_port`` unless ``via`` names a rendezvous host (then
    unicast). Returns once rank 0 is known (``want_all``: every rank, unless
    the coordinator announces a star), or raises :class:`PeerLostError` at
    ``timeout`` saying what was tried, and :class:`WireError` when the
    coordinator refuses this rank (duplicate rank, world size).
    """
    if not secret:
        raise ConfigError("discovery needs the shared secret (datagrams are authenticated)")
    nonce = os.urandom(16).hex()
    fields = {"v": VERSION, "t": "hello", "rank": rank, "world": world, "port": data_port,
              "nonce": nonce}
    hello = _encode(secret, fields)
    target = (via, disc_port) if via else ("<broadcast>", disc_port)
    how = f"unicast to {via}:{disc_port}" if via else f"broadcast to UDP port {disc_port}"
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    ignored = sent = challenges = tables = 0
    started = time.monotonic()
    log.info("discovery: rank %d of %d looking for the coordinator by %s (for up to %g s)",
             rank, world, how, timeout)
    try:
        if not via:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        sock.settimeout(_RETRY)
        deadline = started + timeout
        peers: dict[int, str] = {}
        while time.monotonic() < deadline:
            try:
                sock.sendto(hello, target)
            except OSError as exc:
                raise PeerLostError(f"discovery: cannot send a hello by {how}: {exc}") from None
            sent += 1
            log.debug("discovery: hello #%d sent by %s", sent, how)
            # Answers within this retry period; then say hello again (UDP loses datagrams).
            until = min(deadline, time.monotonic() + _RETRY)
            while time.monotonic() < until:
                try:
                    datagram, source = sock.recvfrom(_MAX_DATAGRAM)
                except socket.timeout:
                    break
                body = _decode(secret, datagram)
                if body is None or body.get("nonce") != nonce:
                    ignored += 1
                    log.debug("discovery: ignored a foreign or unauthenticated datagram from %s",
                              source[0])
                    continue
                if body["t"] == "challenge":
                    session = body.get("session")
                    if not isinstance(session, str) or len(session) > 64:
                        ignored += 1
                        continue
                    challenges += 1
                    log.info("discovery: the coordinator at %s:%d answered with its session; "
                             "saying hello again with it", source[0], source[1])
                    # Say hello again at once, now carrying this run's session.
                    hello = _encode(secret, {**fields, "session": session})
                    break
                if body["t"] == "refused":
                    raise WireError(f"discovery: the coordinator at {source[0]} refused rank "
                                    f"{rank}: {body.get('error')}")
                table = body.get("peers")
                if body["t"] != "table" or not isinstance(table, dict):
                    ignored += 1
                    continue
                tables += 1
                peers = _parse_table(table, source[0], world)
                topology = body.get("topology")
                topology = topology if topology in ("star", "mesh") else None
                log.info("discovery: the coordinator at %s lists %d of %d rank(s)%s", source[0],
                         len(peers), world, "" if 0 not in peers else
                         f"; rank 0 is at {peers[0]}")
                if 0 in peers and (not want_all or topology == "star" or len(peers) >= world):
                    return DiscoveryResult(peers, ignored, topology)
        known = sorted(peers)
        if tables:
            found = f"the coordinator answered but listed only ranks {known} of {world}"
            advice = "start the missing ranks (a mesh waits for every rank)"
        elif challenges:
            found = "the coordinator answered only with its session, never with its table"
            advice = "check for another node with the same rank or a different world size"
        else:
            found = "nothing answered"
            advice = (f"is `meshkit coordinator --discovery` (or [mesh] discovery = true) "
                      f"running{' on ' + via if via else ' on this LAN'} with UDP port "
                      f"{disc_port} reachable, and the same shared secret (a wrong secret "
                      f"gets no answer)?")
            if not via:
                advice += " Without broadcast on this network, use --via HOST"
        raise PeerLostError(
            f"discovery: rank {rank} tried for {time.monotonic() - started:.1f} s: {sent} "
            f"hello(s) by {how}; {found} ({ignored} foreign or unauthenticated datagram(s) "
            f"ignored). {advice}")
    finally:
        sock.close()


def _parse_table(table: dict[str, Any], responder: str, world: int) -> dict[int, str]:
    peers: dict[int, str] = {}
    for key, address in table.items():
        if not (isinstance(key, str) and key.isdigit() and isinstance(address, str)):
            continue
        r = int(key)
        if r >= world:
            continue
        host, _, port = address.rpartition(":")
        peers[r] = f"{host or responder}:{port}"
    return peers


def resolve(config: Any) -> tuple[Any, DiscoveryServer | None]:
    """Turn a ``discover`` NodeConfig into one with peers (and, on rank 0, a running server).

    Rank ``r`` listens on ``data_base + r`` on every interface. The returned
    server (rank 0 only) must stay up while others discover; the transport
    closes it with the group.
    """
    secret = config.secret
    mesh = not config.is_star
    own = f"0.0.0.0:{config.data_base + config.rank}"
    if config.rank == 0:
        server = DiscoveryServer(secret, config.world, data_port=config.data_base,
                                 port=config.disc_port, topology="mesh" if mesh else "star")
        try:
            if not mesh:
                return attrs.evolve(config, bind=config.bind or own), server
            table = server.wait_complete(config.timeout)
        except BaseException:
            server.close()
            raise
        peers = [own if r == 0 else table[r] for r in range(config.world)]
        return attrs.evolve(config, peers=peers), server
    result = discover(secret, rank=config.rank, world=config.world,
                      data_port=config.data_base + config.rank, disc_port=config.disc_port,
                      via=config.via, want_all=mesh, timeout=config.timeout)
    if not mesh or result.topology == "star":
        # A star coordinator: dial it, whatever topology this node assumed.
        return attrs.evolve(config, peers=[result.peers[0]], topology="star"), None
    peers = [own if r == config.rank else result.peers[r] for r in range(config.world)]
    return attrs.evolve(config, peers=peers), None
