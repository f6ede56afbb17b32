"""The public transport contract: a third-party transport built only on it passes the suite.

``QueueLinks`` below is what a transport author writes after reading
docs/transports.md ("Writing a transport"): it implements
:class:`meshkit.transport.Links`, reports through the
:class:`meshkit.transport.LinkEvents` it is given, wraps itself in a plain
:class:`meshkit.transport.Group`, and touches nothing else of the kernel.
Every rank is a thread; each rank's inbox is a queue drained by a reader
thread of its own, as a socket would be.
"""

from __future__ import annotations

import ast
import importlib
import copy
import itertools
import queue
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

import meshkit
import meshkit.transport
from meshkit import ConfigError, PeerLostError
from meshkit.testing import TransportContract
from meshkit.transport import Group, LinkEvents, Links, Message

ROOT = Path(__file__).resolve().parents[2]

_hubs: dict[str, dict[int, QueueLinks]] = {}
_hubs_cv = threading.Condition()
_names = itertools.count()


class QueueLinks(Links):
    """One rank's links: a copy of each message into the peer's inbox queue."""

    def __init__(self, hub: str, rank: int) -> None:
        self.hub = hub
        self.rank = rank
        self.inbox: queue.Queue = queue.Queue()
        self.peers: set[int] = set()
        self.events: LinkEvents | None = None
        self.reader = threading.Thread(target=self._read, daemon=True,
                                       name=f"queue-links-r{rank}")

    @property
    def address(self) -> str:
        return self.hub

    def attach(self, events: LinkEvents) -> None:
        self.events = events

    def transmit(self, peer: int, message: Message, timeout: float | None) -> None:
        with _hubs_cv:
            target = _hubs.get(self.hub, {}).get(peer)
            linked = peer in self.peers
        if target is None or not linked:
            raise PeerLostError(f"rank {peer} is not linked to rank {self.rank}")
        # Copied now: the sender may reuse its arrays once transmit returns.
        target.inbox.put((self.rank, Message(message.src, message.dst, message.tag,
                                             copy.deepcopy(dict(message.payload)),
                                             copy.deepcopy(dict(message.meta)),
                                             message.kind)))

    def drop(self, peer: int) -> None:
        with _hubs_cv:
            target = _hubs.get(self.hub, {}).get(peer)
            linked = peer in self.peers
            self.peers.discard(peer)
        if target is not None and linked:
            target.inbox.put((self.rank, None))  # the other end sees its link close

    def close(self) -> None:
        with _hubs_cv:
            ranks = _hubs.get(self.hub, {})
            if ranks.get(self.rank) is self:
                del ranks[self.rank]
            peers = [ranks[r] for r in self.peers if r in ranks]
            self.peers.clear()
            if not ranks:
                _hubs.pop(self.hub, None)
        for peer in peers:
            peer.inbox.put((self.rank, None))
        self.inbox.put(None)  # ends the reader

    def _read(self) -> None:
        assert self.events is not None
        while True:
            item = self.inbox.get()
            if item is None:
                return
            src, message = item
            if message is None:
                with _hubs_cv:
                    self.peers.discard(src)
                self.events.lost(src, "closed its link", quiet=True)
            else:
                self.events.deliver(message)


class QueueTransport:
    """``connect(node_config) -> Group``, as the component's factory returns it."""

    def connect(self, config) -> Group:
        if not config.secret:
            raise ConfigError("no secret: the queue transport refuses to connect without one")
        hub = config.peers[0]
        links = QueueLinks(hub, config.rank)
        group = Group(links, rank=config.rank, world_size=config.world,
                      timeout=config.timeout, is_star=True)
        links.reader.start()
        deadline = time.monotonic() + config.timeout
        with _hubs_cv:
            ranks = _hubs.setdefault(hub, {})
            ranks[config.rank] = links
            _hubs_cv.notify_all()
            while config.rank != 0 and 0 not in ranks:
                left = deadline - time.monotonic()
                if left <= 0:
                    group.close()
                    raise PeerLostError(f"no coordinator at {hub}")
                _hubs_cv.wait(left)
            coordinator = ranks.get(0)
            if config.rank != 0:
                links.peers.add(0)
                coordinator.peers.add(config.rank)
        if config.rank != 0:
            assert links.events is not None and coordinator.events is not None
            links.events.linked(0)
            coordinator.events.linked(config.rank)
        return group


queue_plugin = types.SimpleNamespace(
    __name__="queue-transport-plugin",
    meshkit_transports=meshkit.hookimpl(
        lambda: [meshkit.Component("queue", QueueTransport, summary="threads and queues")]))


class TestAThirdPartyTransportOnThePublicContract(TransportContract):
    component = "queue"
    plugins = [queue_plugin]

    def coordinator_address(self) -> str:
        return f"queue://contract-{next(_names)}"


def test_a_links_class_missing_a_method_of_the_contract_cannot_be_built() -> None:
    class NoTransmit(Links):
        def attach(self, events):
            pass

        def drop(self, peer):
            pass

    with pytest.raises(TypeError, match="transmit"):
        NoTransmit()


def test_the_group_reads_its_address_from_the_links_and_attaches_once() -> None:
    attached = []

    class Recording(QueueLinks):
        def attach(self, events):
            attached.append(events)
            super().attach(events)

    links = Recording("queue://address", 0)
    group = Group(links, rank=0, world_size=1, timeout=1.0, is_star=True)
    try:
        assert group.address == "queue://address"
        assert len(attached) == 1 and isinstance(attached[0], LinkEvents)
        assert attached[0].dead_reason(1) is None and not attached[0].closed
    finally:
        group.close()
    assert attached[0].closed


def test_a_lost_link_is_declared_dead_once_and_dropped() -> None:
    dropped = []

    class Recording(QueueLinks):
        def drop(self, peer):
            dropped.append(peer)

    links = Recording("queue://lost", 0)
    group = Group(links, rank=0, world_size=3, timeout=1.0, is_star=True)
    seen = []
    group.on_dead = lambda rank, reason: seen.append((rank, reason))
    try:
        links.events.linked(2)
        assert group.joined == [2] and group.live_ranks == [2]
        links.events.lost(2, "the link broke")
        links.events.lost(2, "reported twice")
        assert links.events.dead_reason(2) == "the link broke"
        assert group.dead == {2: "the link broke"} and group.live_ranks == []
        assert dropped == [2] and seen == [(2, "the link broke")]
    finally:
        group.close()


def test_a_delivered_message_waits_in_its_mailbox_for_recv() -> None:
    links = QueueLinks("queue://deliver", 0)
    group = Group(links, rank=0, world_size=2, timeout=1.0, is_star=True)
    try:
        links.events.linked(1)
        links.events.deliver(Message(1, 0, 5, {"x": np.arange(3)}))
        assert group.recv(1, 5)["x"].tolist() == [0, 1, 2]
    finally:
        group.close()


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("meshkit."):
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names
                      if alias.name.startswith("meshkit.")]
    return found


@pytest.mark.parametrize("path", sorted((ROOT / "plugins" / "meshkit_tcp").glob("*.py")),
                         ids=lambda p: p.name)
def test_the_builtin_transports_use_only_meshkits_public_api(path: Path) -> None:
    for module, names in _imports(path):
        assert not any(part.startswith("_") for part in module.split(".")), (
            f"{path.name} imports the private module {module}")
        public = getattr(importlib.import_module(module), "__all__", None)
        assert public is not None, f"{path.name} imports from {module}, which has no __all__"
        for name in names:
            assert name in public, f"{path.name} imports {name} from {module}, not in its __all__"


_TRANSPORT_MODULES = [*sorted((ROOT / "plugins" / "meshkit_tcp").glob("*.py")),
                      ROOT / "plugins" / "meshkit_torchdist" / "group.py"]


@pytest.mark.parametrize("path", _TRANSPORT_MODULES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_builtin_transports_compose_links_own_the_channels_a_group_only_wraps_them(
        path: Path) -> None:
    # Inside out was: a Group subclass holding the sockets, with the Links
    # contract routed through trampolines back to its private methods. A
    # Group subclass may only show attributes (properties) and build itself.
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.ClassDef):
            continue
        bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
        if "Group" not in bases:
            continue
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name != "__init__":
                assert any(isinstance(d, ast.Name) and d.id == "property"
                           for d in item.decorator_list), (
                    f"{path.name}: {node.name}.{item.name} is not a property: what a "
                    f"transport does belongs in its Links")
