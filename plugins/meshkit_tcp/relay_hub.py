"""The coordinator's side of host relays: admitting one, reading its connection, losing it.

Rule: everything rank 0 does with a ``meshkit relay``'s one connection
(docs/protocol.md section 4.1) lives here: checking the relay's hello (the
ranks it carries), routing its ranks through it, its ``joined``/``lost``
control, and the ranks a lost relay takes with it. The relay's own side is
:mod:`meshkit_tcp.relay`. :class:`RelayHub` is a part of
:class:`meshkit_tcp.links.TcpLinks` (a mixin): it shares the links' lock,
routing table and events, which is what keeps a rank behind a relay and a
directly connected one under one set of rules.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import attrs

from meshkit import wire
from meshkit.errors import MeshError, PeerLostError, WireError
from meshkit.node.config import NodeConfig
from meshkit.transport import (
    META_KEY,
    TAG_BYE,
    TAG_RELAY_CTL,
    TAG_REPLY,
    TAG_WELCOME,
    LinkEvents,
    Message,
)

from meshkit_tcp.joining import KIND_CONTROL, KIND_NAMES, STALE_LINK_WAIT, send_refusal

__all__ = ["RelayHub", "RelayLink"]

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class RelayLink:
    """A host relay's connection to the coordinator: the ranks it may carry, those that joined."""

    name: str
    channel: wire.Channel
    ranks: frozenset[int]
    joined: set[int] = attrs.Factory(set)
    #: Ranks whose loss the relay itself reported (no need to tell it back).
    reported: set[int] = attrs.Factory(set)
    #: Body bytes received on this connection (``group.relay_bytes_in``).
    bytes_in: int = 0
    #: Set when its reader ended (the relay said goodbye, or its connection went).
    read_to_end: threading.Event = attrs.Factory(threading.Event)


class RelayHub:
    """Rank 0's host relays (a part of :class:`meshkit_tcp.links.TcpLinks`, which defines the
    attributes declared here)."""

    _lock: threading.Condition
    _events: LinkEvents
    _channels: dict[int, wire.Channel]
    _admitting: set[int]
    _relays: dict[str, RelayLink]
    _via: dict[int, str]
    config: NodeConfig
    rank: int
    world_size: int
    timeout: float
    is_star: bool
    bytes_in: int

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def _refuse(self, where: str, message: str) -> None:
        raise NotImplementedError

    def _spawn(self, target: Any, *args: Any, name: str) -> None:
        raise NotImplementedError


    def _admit_relay(self, channel: wire.Channel, where: str) -> None:
        """A host relay handshook: check what it announces, welcome it, read its link."""
        try:
            hello = channel.recv(timeout=self.timeout)
        except (MeshError, OSError) as exc:
            channel.close()
            self._refuse(f"{where} (relay)", f"sent no relay hello: {exc}")
            return
        name, ranks, problem = self._relay_problem(channel, hello)
        if problem is not None:
            send_refusal(channel, problem)
            self._refuse(f"{where} (relay {name!r})", problem)
            return
        link = RelayLink(name, channel, frozenset(ranks))
        with self._lock:
            # Registered before the welcome, so a rank joining through it at
            # once finds it; _relay_problem reserved the name and ranks.
            self._relays[name] = link
            self._admitting.difference_update(ranks)
            self._lock.notify_all()
        try:
            channel.send(KIND_CONTROL, TAG_WELCOME, {"ok": True, "topology": "star"})
        except (MeshError, OSError) as exc:
            self._relay_lost(link, f"the welcome could not be sent: {exc}")
            return
        log.info("rank 0: host relay %r at %s carries ranks %s", name, where, sorted(ranks))
        self._spawn(self._relay_reader, link, name=f"meshkit-tcp-relay-{name}")

    def _relay_problem(self, channel: wire.Channel, hello: wire.Frame
                       ) -> tuple[str, list[int], str | None]:
        """(name, ranks, why the relay may not join or None); reserves the ranks if not."""
        state = hello.state
        name, ranks = state.get("name"), state.get("ranks")
        if hello.tag != TAG_RELAY_CTL or state.get("op") != "hello":
            return "?", [], "a relay must start with its hello (the ranks it carries)"
        if not isinstance(name, str) or not name or len(name) > 200:
            return "?", [], f"a relay needs a name of 1..200 characters, got {name!r}"
        if (not isinstance(ranks, list) or not ranks or len(ranks) >= self.world_size
                or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks)):
            return name, [], f"relay {name!r} announced no valid list of ranks ({ranks!r})"
        if not self.is_coordinator or not self.is_star:
            return name, [], "only a star's coordinator (rank 0) accepts host relays"
        authorized = self.config.authorized_nodes
        for rank in ranks:
            if not 1 <= rank < self.world_size:
                return name, [], (f"relay {name!r} announced rank {rank}, outside the workers "
                                  f"1..{self.world_size - 1}")
            if authorized is not None:
                problem = authorized.problem(channel.peer_key, rank)
                if problem is not None:
                    return name, [], f"relay {name!r} may not carry rank {rank}: {problem}"
        dead = {r: self._events.dead_reason(r) for r in ranks}
        with self._lock:
            if name in self._relays:
                return name, [], f"a host relay named {name!r} is already connected"
            for rank in ranks:
                if dead[rank] is not None:
                    return name, [], (f"rank {rank} was declared dead ({dead[rank]}); a dead "
                                      f"rank cannot rejoin this run")
                if rank in self._channels or rank in self._admitting:
                    return name, [], (f"relay {name!r} announced rank {rank}, which is "
                                      f"already connected")
                owner = [n for n, link in self._relays.items() if rank in link.ranks]
                if owner:
                    return name, [], (f"relay {name!r} announced rank {rank}, which relay "
                                      f"{owner[0]!r} carries; give each relay its own ranks")
            if len(set(ranks)) != len(ranks):
                return name, [], f"relay {name!r} announced a rank twice: {ranks}"
            self._admitting.update(ranks)
        return name, sorted(ranks), None

    def _relay_reader(self, link: RelayLink) -> None:
        """Read a relay's connection: its ranks' frames, and who joined or died behind it."""
        try:
            self._read_relay(link)
        finally:
            link.read_to_end.set()

    def _read_relay(self, link: RelayLink) -> None:
        events = self._events
        while True:
            try:
                frame = link.channel.recv(timeout=None)
            except (PeerLostError, WireError) as exc:
                self._relay_lost(link, str(exc))
                return
            except Exception as exc:  # a decoder bug must still drop the relay, not hang
                log.exception("rank 0: unexpected error reading from relay %r", link.name)
                self._relay_lost(link, f"unexpected {type(exc).__name__}: {exc}")
                return
            if frame.tag == TAG_BYE:
                self._relay_lost(link, "closed its connection (left the mesh)", quiet=True)
                return
            self.bytes_in += frame.nbytes
            link.bytes_in += frame.nbytes
            state = frame.state
            if frame.tag == TAG_RELAY_CTL:
                problem = self._relay_news(link, state)
                if problem is not None:
                    self._relay_lost(link, f"protocol violation: {problem}")
                    return
                continue
            meta = state.pop(META_KEY, None) or {}
            src = frame.sender
            # A relay speaks for its joined ranks only; its own answers (to a
            # TAG_RELAY request) name a rank it carries.
            allowed = link.ranks if frame.tag == TAG_REPLY and "relay" in state else link.joined
            if not isinstance(meta, dict) or src not in allowed:
                self._relay_lost(link, (
                    f"protocol violation: sent a frame for rank {src}, which it does not "
                    f"carry (or with a malformed {META_KEY!r} entry)"))
                return
            dst = meta.get("dst", self.rank)
            if isinstance(dst, bool) or not isinstance(dst, int) or not 0 <= dst < self.world_size:
                self._relay_lost(link, f"protocol violation: a frame for invalid rank {dst!r}")
                return
            if (events.dead_reason(src) is not None and "relay" not in state
                    and src not in link.joined):
                # A late frame from a rank declared dead (its link was dropped);
                # one that rejoined since is returning, and heard like a direct one.
                continue
            events.deliver(Message(src, dst, frame.tag, state, meta,
                                   KIND_NAMES.get(frame.kind, "control"), raw=frame))
            del frame, state

    def _relay_news(self, link: RelayLink, state: dict[str, Any]) -> str | None:
        """A relay's control message (a rank joined or was lost behind it); a problem or None."""
        op, rank = state.get("op"), state.get("rank")
        if rank not in link.ranks:
            return f"control {op!r} for rank {rank!r}, which it does not carry"
        if op == "joined":
            with self._lock:
                if self._events.dead_reason(rank) is not None and rank in link.joined:
                    # Restarted behind the relay, declared dead, its old link not
                    # dropped yet (the ledger marks a death before the group drops
                    # the link): wait for that drop, bounded. A dead rank that
                    # joins is *returning*, as on a direct link.
                    self._lock.wait_for(lambda: rank not in link.joined, STALE_LINK_WAIT)
                if self._events.closed or rank in link.joined:
                    return None
                link.joined.add(rank)
                self._channels[rank] = link.channel
                self._via[rank] = link.name
                self._lock.notify_all()
            self._events.linked(rank)
            return None
        if op == "lost":
            reason = str(state.get("reason") or "lost")
            with self._lock:
                link.reported.add(rank)
            self._events.lost(rank, f"lost behind host relay {link.name!r}: {reason}",
                              quiet=bool(state.get("quiet")))
            return None
        return f"unknown control {op!r}"

    def _relay_lost(self, link: RelayLink, reason: str, *, quiet: bool = False) -> None:
        """A relay's connection is gone: it takes the ranks that joined through it with it.

        A rank it announced that never joined is not dead, only still
        missing: another relay (the same one restarted) may carry it.
        """
        with self._lock:
            if self._relays.get(link.name) is not link:
                return
            del self._relays[link.name]
            joined = sorted(link.joined)
            for rank in link.ranks:
                if self._via.get(rank) == link.name:
                    del self._via[rank]
                    self._channels.pop(rank, None)
            self._admitting.difference_update(link.ranks)
            self._lock.notify_all()
        link.channel.close()
        if self._events.closed:
            return
        log.log(logging.INFO if quiet else logging.WARNING,
                "rank 0: host relay %r lost (%s); its joined ranks %s go with it", link.name,
                reason, joined)
        for rank in joined:
            self._events.lost(rank, f"its host relay {link.name!r} was lost: {reason}",
                              quiet=quiet)
        with self._lock:
            self._lock.notify_all()  # whoever waits on the group sees the deaths
