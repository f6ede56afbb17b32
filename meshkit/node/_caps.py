"""What a node says it is (:class:`NodeCaps`), and the handshake that says it.

A node advertises its role, devices, platform, cores, memory and software
versions once, before any work moves (:func:`send_caps`); the coordinator
collects every record (:func:`collect_caps`) and places work only where
:meth:`NodeCaps.accepts` holds, so placement follows what the hardware can do
rather than assumption. Every field a record may carry, and the check of its
type when it arrives from the wire, is here.
"""

from __future__ import annotations

import logging
import os
import platform as _platform
import sys
import time
from typing import Any, Mapping, Sequence

import attrs
import numpy

import meshkit
from meshkit import plugins as _plugins
from meshkit.errors import ConfigError, MeshError, PeerLostError, PlacementError, WireError
from meshkit.node._devices import check_device, device_matches, present_devices
from meshkit.node.board import FixedFunction
from meshkit.transport import TAG_CAPS

__all__ = [
    "NodeRole",
    "NodeCaps",
    "platform_tag",
    "local_caps",
    "send_caps",
    "collect_caps",
    "receive_caps",
]

log = logging.getLogger(__name__)


class NodeRole:
    """The two roles a node can have (plain strings on the wire)."""

    WORKER = "worker"
    FIXED_FUNCTION = "fixed_function"




def platform_tag() -> str:
    """A short platform name for logs and placement (``linux``, ``macos``, ...)."""
    plat = sys.platform
    if plat.startswith("linux"):
        # Python on Android reports "linux" before 3.13; the ANDROID_ROOT
        # variable is how the platform itself tells.
        return "android" if "ANDROID_ROOT" in os.environ else "linux"
    return {"darwin": "macos", "win32": "windows", "ios": "ios", "android": "android",
            "emscripten": "wasm", "wasi": "wasm"}.get(plat, plat)


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))  # what this process may actually use
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _memory() -> tuple[int | None, int | None]:
    """(available, total) physical memory in bytes, or None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            info = {}
            for line in fh:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024
        return info.get("MemAvailable"), info.get("MemTotal")
    except (OSError, ValueError, IndexError):
        pass
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    except (AttributeError, ValueError, OSError):
        return None, None


def _optional_int(value: Any, field: str, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise WireError(f"{where}: {field} must be an integer or null, got {value!r}")
    return value


@attrs.frozen
class NodeCaps:
    """What a node tells the coordinator about itself, so placement follows
    what the hardware can do rather than assumption.

    Beyond the reference's rank/role/devices/platform, a node advertises what
    placement heuristics need: usable CPU cores (``cpu_count``, the process's
    affinity), physical memory (``memory_free``/``memory_total`` bytes, None
    where the OS does not say), its ``heap_bytes`` budget and ``device``
    directive from :class:`~meshkit.NodeConfig`, and software versions
    (``python``, ``numpy``, ``meshkit``) so a mismatch shows up in the
    coordinator's log. ``hostname`` and ``pid`` say which process answered.
    """

    rank: int
    role: str = NodeRole.WORKER
    devices: tuple[str, ...] = ("cpu",)
    platform: str = attrs.field(factory=platform_tag)
    fixed_function: FixedFunction | None = None
    cpu_count: int = 1
    memory_free: int | None = None
    memory_total: int | None = None
    heap_bytes: int | None = None
    device: str = "auto"
    machine: str = ""
    hostname: str = ""
    pid: int = 0
    python: str = ""
    numpy: str = ""
    meshkit: str = ""
    #: The node has no storage and asks the coordinator for its training data
    #: (``meshkit node --pull-data``).
    pull_data: bool = False

    def __attrs_post_init__(self) -> None:
        if self.role not in (NodeRole.WORKER, NodeRole.FIXED_FUNCTION):
            raise ConfigError(
                f"NodeCaps.role must be {NodeRole.WORKER!r} or {NodeRole.FIXED_FUNCTION!r}, "
                f"got {self.role!r}")
        if (self.role == NodeRole.FIXED_FUNCTION) != (self.fixed_function is not None):
            raise ConfigError(
                "NodeCaps: a fixed-function rank must carry its FixedFunction descriptor, "
                "and a worker must not")

    @property
    def is_fixed_function(self) -> bool:
        return self.fixed_function is not None

    def check(self, stage: Any) -> None:
        """Raise :class:`PlacementError` unless this node can run ``stage``.

        A worker compiles whatever it is shipped; a fixed-function rank runs
        only the stage its hardware implements (:meth:`FixedFunction.check`).
        """
        if self.fixed_function is not None:
            try:
                self.fixed_function.check(stage)
            except PlacementError as exc:
                raise PlacementError(f"rank {self.rank}: {exc}") from None

    def accepts(self, stage: Any) -> bool:
        """Whether this node can run ``stage`` (see :meth:`check`)."""
        return self.fixed_function is None or self.fixed_function.accepts(stage)

    def check_train(self) -> None:
        """Raise :class:`PlacementError` unless this node can join a training run."""
        ff = self.fixed_function
        if ff is not None:
            # Shipping a training spec to a board does not fail loudly on its
            # own: it never reads the spec, and the first gradient reduce then
            # waits for it for ever. So the coordinator asks first.
            raise PlacementError(
                f"rank {self.rank} is a fixed-function rank implementing the "
                f"pre-synthesized stage [{ff.stage_id}] and cannot train: its datapath "
                f"has no backward pass, and a rank that never joins the reduce stalls "
                f"every rank that does. Leave it out of the training job (train on "
                f"worker ranks only)")

    def has_device(self, wanted: str) -> bool:
        """Whether this node advertised ``wanted`` (``cuda`` matches any ``cuda:N``)."""
        return device_matches(wanted, self.devices)

    def can_train(self) -> bool:
        """Whether this node can join a training run (:meth:`check_train` says why not)."""
        return self.fixed_function is None

    def why_not_train(self) -> str | None:
        """The reason :meth:`can_train` is false, or None when it can train."""
        try:
            self.check_train()
        except PlacementError as exc:
            return str(exc)
        return None

    def to_json(self) -> dict[str, Any]:
        data = attrs.asdict(self, recurse=False)
        data["devices"] = list(self.devices)
        data["fixed_function"] = (self.fixed_function.to_json()
                                  if self.fixed_function is not None else None)
        return data

    @classmethod
    def from_json(cls, data: Any, *, where: str = "NodeCaps") -> NodeCaps:
        """Parse a caps record from the wire, checking every field's type.

        Unknown keys are ignored (a newer node may advertise more than this
        coordinator knows about); wrong types are a :class:`WireError`.
        """
        if not isinstance(data, Mapping):
            raise WireError(f"{where}: expected a JSON object, got {type(data).__name__}")
        known = {f.name: f for f in attrs.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key not in known:
                continue
            if key == "fixed_function":
                if value is not None:
                    try:
                        value = FixedFunction.from_json(value)
                    except ConfigError as exc:
                        raise WireError(f"{where}: {exc}") from None
            elif key == "devices":
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise WireError(f"{where}: devices must be a list of strings, got {value!r}")
                value = tuple(value)
            elif key in ("rank", "cpu_count", "pid"):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise WireError(f"{where}: {key} must be an integer, got {value!r}")
            elif key in ("memory_free", "memory_total", "heap_bytes"):
                value = _optional_int(value, key, where)
            elif key == "pull_data":
                if not isinstance(value, bool):
                    raise WireError(f"{where}: pull_data must be true or false, got {value!r}")
            elif not isinstance(value, str):
                raise WireError(f"{where}: {key} must be a string, got {value!r}")
            kwargs[key] = value
        if "rank" not in kwargs:
            raise WireError(f"{where}: the record has no rank")
        try:
            return cls(**kwargs)
        except ConfigError as exc:
            raise WireError(f"{where}: {exc}") from None


def local_caps(rank: int, *, fixed_function: FixedFunction | None = None,
               device: str = "auto", heap_bytes: int | None = None,
               devices: Sequence[str] | None = None, probe: bool = False) -> NodeCaps:
    """This process's capabilities as rank ``rank`` (what :func:`send_caps` advertises).

    ``devices`` defaults to what is present (:func:`meshkit.node.present_devices`:
    torch is asked only when imported already, when ``device`` names a
    non-cpu device, or with ``probe``); a ``device`` this node does not have
    is a :class:`ConfigError`.
    """
    free, total = _memory()
    if devices is None:
        if fixed_function is not None:
            devices = ["fpga"]
        else:
            devices = present_devices(device, probe=probe)
            check_device(device, devices)
    return NodeCaps(
        rank=rank,
        role=NodeRole.FIXED_FUNCTION if fixed_function is not None else NodeRole.WORKER,
        devices=tuple(devices),
        platform=platform_tag(),
        fixed_function=fixed_function,
        cpu_count=_cpu_count(),
        memory_free=free,
        memory_total=total,
        heap_bytes=heap_bytes,
        device=device,
        machine=_platform.machine(),
        hostname=_platform.node(),
        pid=os.getpid(),
        python=_platform.python_version(),
        numpy=numpy.__version__,
        meshkit=meshkit.__version__,
    )


# -- capability handshake ------------------------------------------------------


def send_caps(group: Any, caps: NodeCaps) -> None:
    """Worker: announce ``caps`` to the coordinator (rank 0)."""
    if caps.rank != group.rank:
        raise ConfigError(
            f"caps advertise rank {caps.rank} but this node is rank {group.rank}")
    group.send(0, TAG_CAPS, {"caps": caps.to_json()})


def collect_caps(group: Any, *, timeout: float | None = None,
                 plugins: Any = None, hook: bool = True,
                 minimum: int | None = None) -> list[NodeCaps]:
    """Coordinator: collect every worker's :class:`NodeCaps`, in rank order.

    Records are taken as they arrive; ``meshkit_node_joined(caps=...)`` fires
    for each in order of arrival (on ``plugins``, a
    :class:`meshkit.plugins.PluginSet`; the default set when None; no hook
    when ``hook`` is false). A worker that never announces itself is a
    :class:`PeerLostError` at ``timeout`` naming the ranks still missing; a
    record claiming another rank's identity is a :class:`WireError`. With
    ``minimum``, it returns as soon as that many workers have announced
    themselves (the others may join later: see ``[mesh] min_workers``).
    """
    if group.rank != 0:
        raise MeshError("collect_caps() runs on the coordinator (rank 0)")
    if hook and plugins is None:
        plugins = _plugins.default()
    deadline = time.monotonic() + (group.timeout if timeout is None else timeout)
    found: dict[int, NodeCaps] = {}
    expected = set(range(1, group.world_size))
    while expected - found.keys() - set(group.dead):
        if minimum is not None and len(found) >= minimum:
            return [found[r] for r in sorted(found)]
        remaining = deadline - time.monotonic()
        try:
            src, payload = group.recv(None, TAG_CAPS, timeout=max(remaining, 0.0))
        except PeerLostError as exc:
            missing = sorted(expected - found.keys())
            raise PeerLostError(
                f"capability handshake: rank(s) {missing} did not announce themselves "
                f"({exc})") from None
        caps = NodeCaps.from_json(payload.get("caps"), where=f"caps from rank {src}")
        if caps.rank != src:
            raise WireError(
                f"capability handshake: rank {src} advertised the caps of rank {caps.rank}; "
                f"each node must announce its own rank")
        if src in found:
            log.warning("rank %d announced its caps twice; keeping the first", src)
            continue
        found[src] = caps
        log.info("rank %d joined: %s %s, devices %s", src, caps.role, caps.platform,
                 ",".join(caps.devices))
        if hook:
            _plugins.notify(plugins, "meshkit_node_joined", caps=caps)
    dead = expected - found.keys()
    if dead:
        raise PeerLostError(
            f"capability handshake: rank(s) {sorted(dead)} died before announcing "
            f"themselves: " + "; ".join(f"rank {r}: {group.dead.get(r)}" for r in sorted(dead)))
    return [found[r] for r in sorted(found)]


def receive_caps(group: Any, rank: int, *, timeout: float | None = None,
                 plugins: Any = None, hook: bool = True) -> NodeCaps:
    """Coordinator: the :class:`NodeCaps` of one worker that joined late or came back.

    The same checks as :func:`collect_caps` (and the same
    ``meshkit_node_joined`` hook), for a rank taken in between rounds. A
    rank that announces nothing within ``timeout`` is a :class:`PeerLostError`.
    """
    payload = group.recv(rank, TAG_CAPS, timeout=group.timeout if timeout is None else timeout)
    caps = NodeCaps.from_json(payload.get("caps"), where=f"caps from rank {rank}")
    if caps.rank != rank:
        raise WireError(f"capability handshake: rank {rank} advertised the caps of rank "
                        f"{caps.rank}; each node must announce its own rank")
    log.info("rank %d joined: %s %s, devices %s", rank, caps.role, caps.platform,
             ",".join(caps.devices))
    if hook:
        _plugins.notify(_plugins.default() if plugins is None else plugins,
                        "meshkit_node_joined", caps=caps)
    return caps
