"""How a node joins a mesh: :class:`NodeConfig`, with environment parity.

Everything a node needs to join (rank, world, peers or discovery, its
device and heap budget, the board it drives, the transport and the shared
secret) is one frozen record, checked when it is built; the environment
(:meth:`NodeConfig.from_env`) is read in one place.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import attrs

from meshkit import plugins
from meshkit.errors import ConfigError
from meshkit.node._caps import NodeCaps, NodeRole, local_caps
from meshkit.node.board import FixedFunction
from meshkit.wire import DEFAULT_PARTIAL_BYTES, DEFAULT_SEGMENT_BYTES, check_segment_bytes

#: The longest timeout meshkit accepts, in seconds (about 31 years): far
#: below threading.TIMEOUT_MAX and the socket layer's limit (about 9.2e9 s
#: on Linux), where waits overflow deep in a transport instead of failing
#: at configuration time.
MAX_TIMEOUT = 1e9

__all__ = ["NodeConfig", "caps_for", "MAX_TIMEOUT", "DEFAULT_DISC_PORT", "DEFAULT_DATA_BASE"]

DEFAULT_DISC_PORT = 29600
DEFAULT_DATA_BASE = 29500
TOPOLOGIES = ("star", "mesh")


def _peers(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [p for p in value.split(",")]
    return tuple(str(p).strip() for p in value if str(p).strip())


@attrs.frozen
class NodeConfig:
    """Everything a node needs to join a mesh; no environment required.

    ``peers`` takes either form: ``world`` addresses indexed by rank (a full
    mesh, every rank reaches every other) or exactly one address, the
    coordinator's (a star: workers dial out and nothing dials them, which is
    what a phone on Wi-Fi can do). With ``discover`` set, peers are found by
    UDP on ``disc_port`` (broadcast, or unicast to ``via``), and rank ``r``
    listens on ``data_base + r``.
    """

    rank: int = attrs.field(validator=attrs.validators.instance_of(int))
    world: int = attrs.field(validator=attrs.validators.instance_of(int))
    peers: tuple[str, ...] = attrs.field(default=(), converter=_peers)
    topology: str = attrs.field(default="mesh", validator=attrs.validators.in_(TOPOLOGIES))
    discover: bool = False
    disc_port: int = DEFAULT_DISC_PORT
    data_base: int = DEFAULT_DATA_BASE
    via: str | None = None
    device: str = "auto"
    heap_bytes: int | None = None
    fixed_function: FixedFunction | None = None
    transport: str = "tcp"
    #: The transport's options table (``[transport]`` in a config), checked
    #: against the transport's options class when connecting.
    transport_options: dict[str, Any] = attrs.field(factory=dict, converter=dict, hash=False)
    secret: bytes | None = attrs.field(default=None, repr=False)
    timeout: float = 30.0
    bind: str | None = None
    #: Encrypt frame bodies (the default); False only authenticates them.
    #: Every node of a mesh must agree (the handshake checks it).
    encrypt: bool = True
    #: This node's :class:`meshkit.wire.NodeKey` (``meshkit node --key``),
    #: proven to every peer in the handshake; None: none.
    node_key: Any = attrs.field(default=None, repr=False)
    #: The coordinator's :class:`meshkit.wire.AuthorizedNodes`: when set,
    #: only nodes proving a listed, unrevoked key for their rank may join.
    authorized_nodes: Any = attrs.field(default=None, repr=False)
    #: ``[mesh] trust_network``: the network between the nodes is trusted, so a
    #: transport that authenticates nothing (``torchdist``) may use a
    #: non-loopback address. False: such a transport refuses one.
    trust_network: bool = False
    #: The most one frame of a model-sized message carries on this node's
    #: links (``[mesh] segment_bytes``, ``meshkit node --segment-bytes``): a
    #: bigger body travels in segments; each link cuts at the smaller of its
    #: two ends' values (docs/transports.md).
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    #: ``[mesh] resume_seconds`` (``meshkit node --resume-seconds``): how long a
    #: star link cut part-way is held for the worker to redial, its cut
    #: transfers resuming (0: off; a lost link is a death at once).
    resume_seconds: float = 0.0
    #: ``[mesh] resume_bytes``: bytes of cut transfers kept per peer to resume.
    resume_bytes: int = DEFAULT_PARTIAL_BYTES

    def __attrs_post_init__(self) -> None:
        if self.world < 1:
            raise ConfigError(f"world must be at least 1, got {self.world}")
        if not 0 <= self.rank < self.world:
            raise ConfigError(
                f"rank {self.rank} is out of range for a world of {self.world} "
                f"(ranks are 0..{self.world - 1}; the coordinator is rank 0)")
        if self.peers and len(self.peers) not in (1, self.world):
            raise ConfigError(
                f"peers: got {len(self.peers)} address(es); expected {self.world} "
                f"(one per rank, for a mesh) or 1 (the coordinator, for a star)")
        for port_name in ("disc_port", "data_base"):
            port = getattr(self, port_name)
            # Rank 0 may run its discovery responder on any free port (0).
            lowest = 0 if port_name == "disc_port" and self.rank == 0 else 1
            if not lowest <= port < 65536:
                raise ConfigError(f"{port_name} must be a port number 1..65535, got {port}")
        if self.discover and self.data_base + self.world - 1 > 65535:
            # Discovery silently drops an announcement of a port past 65535,
            # so the node would only time out.
            raise ConfigError(
                f"data_base {self.data_base}: with discovery, rank r listens on data_base + "
                f"r, so a world of {self.world} needs ports up to "
                f"{self.data_base + self.world - 1}; choose a data_base of at most "
                f"{65536 - self.world}")
        problem = check_segment_bytes(self.segment_bytes)
        if problem:
            raise ConfigError(problem)
        if not 0 <= self.resume_seconds <= MAX_TIMEOUT:
            raise ConfigError(f"resume_seconds must be 0 (off) or a number of seconds up to "
                              f"{MAX_TIMEOUT:.0e}, got {self.resume_seconds}")
        if not 0 <= self.resume_bytes < 1 << 63:
            raise ConfigError(f"resume_bytes must be a byte count >= 0, got {self.resume_bytes}")
        if self.heap_bytes is not None and self.heap_bytes <= 0:
            raise ConfigError(f"heap_bytes must be positive, got {self.heap_bytes}")
        if self.secret is not None and not isinstance(self.secret, (bytes, bytearray)):
            raise ConfigError(
                f"the shared secret must be bytes, got {type(self.secret).__name__}; pass "
                f"secret.encode() (or read the secret file in binary mode)")
        # inf (or anything near threading.TIMEOUT_MAX) overflows socket and
        # lock timeouts deep in a transport; NaN compares false with
        # everything and would disable every timeout.
        if not 0 < self.timeout <= MAX_TIMEOUT:
            raise ConfigError(f"timeout must be a number of seconds > 0 and at most "
                              f"{MAX_TIMEOUT:.0e} (about 31 years), got {self.timeout}")

    @property
    def role(self) -> str:
        return NodeRole.FIXED_FUNCTION if self.fixed_function else NodeRole.WORKER

    @property
    def is_star(self) -> bool:
        """A single peer address means a star, whatever ``topology`` says."""
        return self.topology == "star" or len(self.peers) == 1

    def with_secret(self, secret: bytes) -> NodeConfig:
        return attrs.evolve(self, secret=secret)

    def caps(self) -> NodeCaps:
        """The :class:`meshkit.NodeCaps` this node advertises in the handshake."""
        return caps_for(self)

    def connect(self) -> Any:
        """Build the selected transport and join the mesh; returns its ``Group``."""
        return plugins.create("transport", self.transport,
                              self.transport_options or None).connect(self)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> NodeConfig:
        """Read RANK, WORLD, PEERS, DISCOVER, DISC_PORT, DATA_PORT, DISCOVER_HOST,
        TOPOLOGY, DIAL_OUT, HEAP_MB, DEVICE (and MESHKIT_SECRET).

        Every malformed value is a :class:`ConfigError` naming the variable.
        ``overrides`` win over the environment (the CLI passes its flags).
        """
        env = os.environ if environ is None else environ

        def integer(name: str, default: int, low: int = 0, high: int | None = None) -> int:
            raw = env.get(name)
            if raw is None or raw.strip() == "":
                return default
            try:
                value = int(raw.strip())
            except ValueError:
                raise ConfigError(f"{name} must be an integer, got {raw!r}") from None
            if value < low or (high is not None and value > high):
                bound = f"{low}..{high}" if high is not None else f">= {low}"
                raise ConfigError(f"{name} must be {bound}, got {value}")
            return value

        def flag(name: str) -> bool:
            raw = env.get(name)
            if raw is None or raw.strip() == "":
                return False
            value = raw.strip().lower()
            if value in ("1", "true", "yes", "on"):
                return True
            if value in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{name} must be 0 or 1 (or true/false), got {raw!r}")

        kwargs: dict[str, Any] = {
            "rank": integer("RANK", 0),
            "world": integer("WORLD", 1, low=1),
            "device": env.get("DEVICE") or "auto",
        }
        topology = (env.get("TOPOLOGY") or "").strip().lower()
        if topology and topology not in TOPOLOGIES:
            raise ConfigError(f"TOPOLOGY must be 'star' or 'mesh', got {env['TOPOLOGY']!r}")
        kwargs["topology"] = "star" if (topology == "star" or flag("DIAL_OUT")) else (
            topology or "mesh")
        heap_mb = integer("HEAP_MB", 0, low=1) if env.get("HEAP_MB") else None
        if heap_mb:
            kwargs["heap_bytes"] = heap_mb << 20
        if flag("DISCOVER"):
            kwargs["discover"] = True
            kwargs["disc_port"] = integer("DISC_PORT", DEFAULT_DISC_PORT, 1, 65535)
            kwargs["data_base"] = integer("DATA_PORT", DEFAULT_DATA_BASE, 1, 65535)
            if env.get("DISCOVER_HOST"):
                kwargs["via"] = env["DISCOVER_HOST"].strip()
        elif env.get("PEERS"):
            kwargs["peers"] = env["PEERS"]
        if env.get("MESHKIT_SECRET"):
            kwargs["secret"] = env["MESHKIT_SECRET"].encode()
        kwargs.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kwargs)


def caps_for(config: NodeConfig, **kwargs: Any) -> NodeCaps:
    """:func:`~meshkit.node.local_caps` for a :class:`NodeConfig` (``kwargs`` pass on)."""
    return local_caps(config.rank, fixed_function=config.fixed_function,
                      device=config.device, heap_bytes=config.heap_bytes, **kwargs)
