"""One TOML file, structured into attrs classes: the config's own shape, checked.

Loading checks the file's own shape (known tables, known keys, right types);
resolving it against the plugins (every selected component looked up, its
table structured into the component's options class) is the coordinator's
plan: :class:`meshkit.train.Plan`, :func:`meshkit.train.resolve` and
:func:`meshkit.train.check` (this module's before issue 33; it cannot
re-export them: ``meshkit.train`` imports this module, so that would be an
import cycle). Every problem is a :class:`ConfigError` naming the file, the
table and the key.
"""

from __future__ import annotations

import math
import os
import sys
import tomllib
from pathlib import Path
from typing import Any, Mapping

import attrs

from meshkit import wire
from meshkit.aggregation import DEFAULT_PIECE_BYTES
from meshkit.errors import ConfigError
from meshkit.node.config import MAX_TIMEOUT
from meshkit.options import closest, structure_strict
from meshkit.partitioner import DEFAULT_PARTITIONER
from meshkit.simulation import Speeds, read_speeds_file
from meshkit.task import reference_of

__all__ = [
    "RunTable",
    "MeshTable",
    "Selection",
    "Config",
    "load_config",
    "parse_config",
    "MIN_SECRET_BYTES",
    "SimulationTable",
    "DEFAULT_SECURE_AGGREGATION",
]

LAUNCHES = ("local", "external")
TOPOLOGIES = ("star", "mesh")
#: The one minimum length of a shared secret, whatever its source.
MIN_SECRET_BYTES = wire.MIN_SECRET


def _finite(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    # TOML spells inf; socket and lock timeouts overflow on it (and on
    # anything near 9.2e9 s) deep in a transport.
    if not math.isfinite(value) or value > MAX_TIMEOUT:
        raise ValueError(f"{attribute.name} must be a finite number of seconds, at most "
                         f"{MAX_TIMEOUT:.0e}, got {value}")


def _check_address(name: str, value: str) -> None:
    host, sep, port = str(value).strip().rpartition(":")
    if not sep or not host.strip("[]"):
        raise ValueError(f"{name} must be host:port (e.g. 127.0.0.1:0), got {value!r}")
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"{name} {value!r}: port {port!r} is not a number") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"{name} {value!r}: port {number} is out of range 0..65535 "
                         f"(0 picks a free port)")


def _segment_bytes(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    # Checked when the file loads: the hello announces it in 64 KiB units.
    problem = wire.check_segment_bytes(value, attribute.name)
    if problem:
        raise ValueError(problem)


def _listen_address(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    # Checked when the file loads, so `meshkit check` refuses the address the
    # transport would refuse only once the run has started.
    _check_address(attribute.name, value)


def _peer_addresses(instance: Any, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
    # Every rank of a mesh dials the others' addresses, so none may be port 0.
    for i, address in enumerate(value):
        name = f"{attribute.name}[{i}]"
        _check_address(name, address)
        if str(address).strip().rpartition(":")[2].strip() == "0":
            raise ValueError(f"{name} {address!r}: a mesh peer needs a real port (the other "
                             f"ranks dial it), not 0")


@attrs.frozen
class RunTable:
    """``[run]``: what to train and where results go."""

    task: str = "digits"
    #: numpy seeds are non-negative (a negative one would fail deep in the run).
    seed: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    out: str = "runs/meshkit"
    #: A progress line every this many rounds (and for the last round, and any
    #: round that lost a worker or a client); metrics.jsonl still gets every round.
    progress_every: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    #: Where per-client figures (who served each client, its examples and its own
    #: evaluation) go: "inline" in each metrics.jsonl row, "file" streamed to
    #: OUT/clients.jsonl (one line per client and round), or "none".
    client_metrics: str = attrs.field(default="inline", validator=attrs.validators.in_(
        ("inline", "file", "none")))
    #: Keep the coordinator's global model and outer-optimizer state in memory-mapped
    #: safetensors files in ``spill_dir`` instead of in memory (:mod:`meshkit.spill`).
    spill: bool = False
    #: Where the spill's files go ("": ``OUT/spill``, beside the checkpoint).
    spill_dir: str = ""


@attrs.frozen
class MeshTable:
    """``[mesh]``: which transport, which shape, who starts the workers."""

    transport: str = "tcp"
    topology: str = attrs.field(default="star", validator=attrs.validators.in_(TOPOLOGIES))
    launch: str = attrs.field(default="local", validator=attrs.validators.in_(LAUNCHES))
    workers: int = attrs.field(default=2, validator=attrs.validators.ge(1))
    #: ``launch = "local"``: start this many host relays (``meshkit relay``) on
    #: this machine; the workers are split among them in contiguous blocks of
    #: ranks and each dials its relay (docs/scaling-out.md). 0: none.
    relays: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    bind: str = attrs.field(default="127.0.0.1:0", validator=_listen_address)
    #: ``topology = "mesh"``: one ``host:port`` per rank, the coordinator's
    #: first; rank r listens at its own and dials the lower ranks'. Empty with
    #: ``launch = "local"``: free loopback ports picked when the run starts.
    peers: tuple[str, ...] = attrs.field(default=(), converter=tuple,
                                         validator=_peer_addresses)
    secret_file: str = ""
    #: Encrypt frame bodies (AES-256-GCM). ``false`` is the explicit opt-out:
    #: bodies then travel in clear, still authenticated (docs/security.md).
    encrypt: bool = True
    #: A file of node public keys the coordinator admits (``meshkit keygen``;
    #: format in docs/security.md); empty: any node holding the secret.
    authorized_nodes: str = ""
    #: Run the UDP discovery responder, so nodes can join with ``--discover``.
    discovery: bool = False
    #: The discovery responder's UDP port (0: any free port, printed at start).
    discovery_port: int = attrs.field(default=29600, validator=[attrs.validators.ge(0),
                                                                attrs.validators.le(65535)])
    #: The network between the nodes is trusted: a transport that authenticates
    #: nothing (``torchdist``: torch.distributed) may then use a non-loopback
    #: address, which it refuses otherwise (docs/security.md).
    trust_network: bool = False
    #: Seconds a read or write may stall before the peer is declared dead.
    timeout: float = attrs.field(default=30.0, validator=[attrs.validators.gt(0), _finite])
    #: Seconds the coordinator waits for every worker to join.
    join_timeout: float = attrs.field(default=60.0,
                                      validator=[attrs.validators.gt(0), _finite])
    #: Start once this many workers have joined (0: all of them); the rest
    #: are taken in at a round boundary when they join (late joiners).
    min_workers: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    #: The most one frame of a model-sized message carries (bytes, a multiple
    #: of 64 KiB): a bigger body travels as a lead frame and segments of at
    #: most this size, each authenticated like any frame (docs/transports.md).
    segment_bytes: int = attrs.field(default=wire.DEFAULT_SEGMENT_BYTES,
                                     validator=_segment_bytes)
    #: The most one piece of a contribution carries (bytes): the round engine pulls a
    #: model larger than this piece by piece and folds each as it arrives, never holding
    #: a whole contribution (docs/protocol.md, the ``take`` request).
    piece_bytes: int = attrs.field(default=DEFAULT_PIECE_BYTES, validator=[
        attrs.validators.instance_of(int), attrs.validators.ge(1 << 16),
        attrs.validators.le(1 << 40)])
    #: Seconds a star link cut part-way is held open for its worker to redial: the
    #: worker redials the coordinator in the same process and a cut model-sized
    #: message continues from its last verified segment (docs/transports.md). 0 (the
    #: default): off, a lost link is a dead worker at once, as before.
    resume_seconds: float = attrs.field(default=0.0, validator=[attrs.validators.ge(0),
                                                                _finite])
    #: Bytes of cut transfers each end keeps *per peer* for their senders to resume
    #: (each peer its own quota; a node keeps at most 4 of them per peer).
    resume_bytes: int = attrs.field(default=wire.DEFAULT_PARTIAL_BYTES, validator=[
        attrs.validators.instance_of(int), attrs.validators.ge(0),
        attrs.validators.le(1 << 62)])

    def __attrs_post_init__(self) -> None:
        if self.min_workers > self.workers:
            raise ValueError(f"min_workers = {self.min_workers} is more than workers = "
                             f"{self.workers}; use at most {self.workers} (0: all)")
        if self.resume_seconds and (self.topology != "star" or self.relays):
            raise ValueError(
                f"resume_seconds = {self.resume_seconds:g} needs a star whose workers dial the "
                f"coordinator directly; this run has topology = {self.topology!r} and relays = "
                f"{self.relays}: set resume_seconds = 0, or use a star without relays")

    def link_settings(self) -> dict[str, Any]:
        """The ``NodeConfig`` fields of every link: segment size and resume."""
        return {"segment_bytes": self.segment_bytes, "resume_seconds": self.resume_seconds,
                "resume_bytes": self.resume_bytes}


@attrs.frozen
class Selection:
    """A selected component: its kind, name, raw options table and where it came from."""

    kind: str
    name: str
    options: Mapping[str, Any]
    where: str


#: (config table, component kind, default name); the name key is ``name``.
_SELECTED_TABLES = {
    "strategy": ("strategy", "federated"),
    "aggregator": ("aggregator", "fedavg"),
    "outer_optimizer": ("outer_optimizer", "average"),
}
_KNOWN_TABLES = ("run", "mesh", "strategy", "aggregator", "outer_optimizer", "partitioner",
                 "task", "transport", "observers", "attack", "privacy", "simulation",
                 "secure_aggregation", "compression")
#: Tables written as arrays of tables (``[[observers]]``): one selection per entry.
_ARRAY_TABLES = ("observers",)


@attrs.frozen
class AttackTable:
    """``[attack]``: which attack (``name`` and its options) and which clients run it.

    Exactly one of ``clients`` (client ids) and ``fraction`` (of the run's
    clients, chosen by a permutation seeded with the run seed) says who
    attacks; docs/configuration.md.
    """

    selection: Selection
    clients: tuple[int, ...] = ()
    fraction: float = 0.0


def _attack_table(options: dict[str, Any], path: str) -> AttackTable:
    chosen = options.pop("name", None)
    if not isinstance(chosen, str) or not chosen:
        raise ConfigError(f"{path}: [attack] name: expected an attack name (e.g. \"sign-flip\"), "
                          f"got {chosen!r}")
    clients = options.pop("clients", None)
    fraction = options.pop("fraction", None)
    if (clients is None) == (fraction is None):
        raise ConfigError(
            f"{path}: [attack] clients / fraction: give exactly one, the attacking clients' "
            f"ids (clients = [0, 3]) or the share of the clients that attack "
            f"(fraction = 0.2)")
    if clients is not None and (not isinstance(clients, list) or not clients or any(
            isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in clients)):
        raise ConfigError(f"{path}: [attack] clients: expected a non-empty list of client ids "
                          f"(integers >= 0), got {clients!r}")
    if fraction is not None and (isinstance(fraction, bool)
                                 or not isinstance(fraction, (int, float))
                                 or not 0 < fraction <= 1):
        raise ConfigError(f"{path}: [attack] fraction: expected a number in (0, 1], got "
                          f"{fraction!r}")
    return AttackTable(Selection("attack", chosen, options, "[attack]"),
                       clients=tuple(clients or ()), fraction=float(fraction or 0.0))


def _sigma(instance: Any, attribute: attrs.Attribute, value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and 0 <= value <= 10):
        raise ValueError(f"sigma must be a number from 0 to 10, got {value}")


def _clock(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    if value != "virtual":
        raise ValueError(f"clock = {value!r}: the only clock is \"virtual\" (real time needs "
                         f"no [simulation] table)")


def _speeds(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    if value != "lognormal":
        raise ValueError(f"speeds = {value!r}: durations are \"lognormal\" (with sigma), or "
                         f"come from a speeds_file")


@attrs.frozen
class SimulationTable:
    """``[simulation]``: the virtual clock of a simulated federation (docs/async.md).

    Durations are lognormal (``sigma``, default 1.0; median 1 simulated
    second) unless ``speeds_file`` names a ``client,seconds`` CSV
    (:mod:`meshkit.simulation`).
    """

    #: The only clock this table configures (real time needs no table).
    clock: str = attrs.field(default="virtual", validator=_clock)
    #: How client durations are drawn: "lognormal" (the one distribution).
    speeds: str = attrs.field(default="lognormal", validator=_speeds)
    #: The lognormal's sigma (default 1.0); not with speeds_file.
    sigma: float | None = attrs.field(default=None, validator=_sigma)
    #: A CSV of ``client,seconds`` lines instead of drawn durations.
    speeds_file: str = ""


#: ``[secure_aggregation] name`` when the table gives none: the built-in scheme
#: (a keys request that names no scheme means this one, so older workers interoperate).
DEFAULT_SECURE_AGGREGATION = "secagg+"


@attrs.frozen
class Config:
    """A parsed config file. Selections are not yet checked against plugins."""

    path: str
    run: RunTable
    mesh: MeshTable
    strategy: Selection
    aggregator: Selection
    outer_optimizer: Selection
    task: Selection
    transport: Selection
    #: ``[partitioner]``: how a federated run splits the training set into clients.
    #: None (no table): contiguous row blocks, which need no plugin.
    partitioner: Selection | None = None
    #: ``[[observers]]``: trackers that hear the run's events, one per entry, in order.
    observers: tuple[Selection, ...] = ()
    #: ``[attack]``: Byzantine clients for testing a defence (None: every client honest).
    attack: AttackTable | None = None
    #: ``[privacy]``: the differential-privacy mechanism of a federated run (None: none).
    privacy: Selection | None = None
    #: ``[simulation]``: the virtual clock (None: real time).
    simulation: SimulationTable | None = None
    #: ``[compression]``: how workers compress what they upload (None: sent whole).
    compression: Selection | None = None
    #: ``[compression] broadcast``: the coordinator sends each worker a compressed delta
    #: against the model it holds, too (a kernel key: the compressor never sees it).
    compression_broadcast: bool = False
    #: ``[compression] clip_range``: the shared grid a linear batched round's clients
    #: quantise onto, so each worker sends one exact sum (a kernel key, as broadcast).
    compression_clip_range: float | None = None
    #: ``[compression] residual``: where error feedback's residual is kept, ``"coordinator"``
    #: (its client-local store; the residual travels with each fit) or ``"worker"`` (the
    #: worker that serves the client keeps it and it never travels; a kernel key).
    compression_residual: str = "coordinator"

    def speeds(self) -> Speeds | None:
        """The ``[simulation]`` clients' durations (None without the table); a
        speeds file is read here, so a bad one is refused before the run starts."""
        table = self.simulation
        if table is None:
            return None
        if table.speeds_file:
            if table.sigma is not None:
                raise ConfigError(
                    f"{self.path}: [simulation] sigma: durations come from speeds_file = "
                    f"{table.speeds_file!r}, so sigma would do nothing; drop one of them")
            where = f"{self.path}: [simulation] speeds_file"
            return Speeds(seed=self.run.seed, table=read_speeds_file(table.speeds_file, where),
                          source=where)
        return Speeds(seed=self.run.seed, sigma=1.0 if table.sigma is None else table.sigma)

    #: ``[secure_aggregation]``: the scheme that hides each client's update (None: none).
    secure_aggregation: Selection | None = None

    def selections(self) -> list[Selection]:
        chosen = [self.task, self.strategy, self.aggregator, self.outer_optimizer]
        if self.partitioner is not None:
            chosen.append(self.partitioner)
        if self.privacy is not None:
            chosen.append(self.privacy)
        if self.compression is not None:
            chosen.append(self.compression)

        if self.secure_aggregation is not None:
            chosen.append(self.secure_aggregation)
        chosen.append(self.transport)
        if self.attack is not None:
            chosen.append(self.attack.selection)
        return chosen

    @property
    def partitioner_name(self) -> str:
        """The selected partitioner, ``contiguous`` when there is no ``[partitioner]`` table."""
        return DEFAULT_PARTITIONER if self.partitioner is None else self.partitioner.name

    def secret(self, environ: Mapping[str, str] | None = None) -> bytes | None:
        """The configured shared secret (``MESHKIT_SECRET`` wins over ``secret_file``).

        Both sources become bytes as :mod:`meshkit.wire` says (and
        docs/security.md): whitespace stripped at both ends, never decoded,
        at least 16 bytes; the file must be private (mode 0600).
        """
        env = os.environ if environ is None else environ
        if (env.get("MESHKIT_SECRET") or "").strip():
            return wire.secret_from_text(env["MESHKIT_SECRET"])
        if not self.mesh.secret_file:
            return None
        return wire.read_secret_file(Path(self.mesh.secret_file),
                                     f"{self.path}: [mesh] secret_file")

    def authorized_nodes(self) -> wire.AuthorizedNodes | None:
        """The parsed ``[mesh] authorized_nodes`` file, or None when not set."""
        if not self.mesh.authorized_nodes:
            return None
        return wire.load_authorized_nodes(Path(self.mesh.authorized_nodes),
                                          f"{self.path}: [mesh] authorized_nodes")


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and parse a TOML config file."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: TOML files are UTF-8, and byte "
                          f"{exc.start} is not ({exc.reason})") from None
    return parse_config(data, path=path)


#: Why a component other than the task cannot be given as an object.
_ONLY_TASK = ("; only [run] task may be an object (a task defined in your script); every other "
              "component is selected by the name a plugin registers for it, so that each "
              "process finds the same one: register yours through a plugin "
              "(docs/writing-a-plugin.md) and select it by name")


def _with_task_reference(data: Mapping[str, Any], path: str) -> Mapping[str, Any]:
    """``data`` with a task given as an object (``meshkit.run({"run": {"task": Task}})``, a
    notebook's habit) or as ``"__main__:name"`` replaced by the reference workers import
    (:func:`meshkit.task.reference_of`)."""
    run = data.get("run")
    if not isinstance(run, Mapping) or "task" not in run:
        return data
    task = run["task"]
    if isinstance(task, str):
        module, _, attribute = task.partition(":")
        main = sys.modules.get("__main__")
        if module != "__main__" or main is None or not hasattr(main, attribute):
            return data
        task = getattr(main, attribute)
    try:
        reference = reference_of(task)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return {**data, "run": {**run, "task": reference}}


def parse_config(data: Mapping[str, Any], *, path: str = "<config>") -> Config:
    """Structure an already-parsed TOML document."""
    for section, value in data.items():
        if section not in _KNOWN_TABLES:
            near = closest(section, _KNOWN_TABLES)
            raise ConfigError(
                f"{path}: [{section}]: unknown table"
                + (f" (did you mean [{near}]?)" if near else "") + "; known tables are "
                + ", ".join(f"[{t}]" for t in _KNOWN_TABLES))
        if section in _ARRAY_TABLES:
            if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
                raise ConfigError(f"{path}: [[{section}]]: expected an array of tables (one "
                                  f"[[{section}]] header per entry), got {value!r}")
        elif not isinstance(value, Mapping):
            raise ConfigError(f"{path}: {section}: expected a table, got {value!r}")

    data = _with_task_reference(data, path)

    def table(name: str) -> dict[str, Any]:
        return dict(data.get(name, {}))

    def strict(cls: type, name: str) -> Any:
        try:
            return structure_strict(table(name), cls, where=f"[{name}]")
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None

    run = strict(RunTable, "run")
    mesh = strict(MeshTable, "mesh")
    simulation = strict(SimulationTable, "simulation") if "simulation" in data else None

    selections: dict[str, Selection] = {}
    for name, (kind, default) in _SELECTED_TABLES.items():
        options = table(name)
        chosen = options.pop("name", default)
        if not isinstance(chosen, str) or not chosen:
            raise ConfigError(f"{path}: [{name}] name: expected a component name, got "
                              f"{chosen!r}{_ONLY_TASK if not isinstance(chosen, str) else ''}")
        selections[name] = Selection(kind, chosen, options, f"[{name}]")

    def optional(name: str, default: str | None, what: str) -> Selection | None:
        """The selection of an optional table (None when the config has no such table)."""
        if name not in data:
            return None
        options = table(name)
        chosen = options.pop("name", default)
        if not isinstance(chosen, str) or not chosen:
            raise ConfigError(f"{path}: [{name}] name: expected {what}, got {chosen!r}"
                              f"{_ONLY_TASK if not isinstance(chosen, str) else ''}")
        return Selection(name, chosen, options, f"[{name}]")

    partitioner = optional("partitioner", DEFAULT_PARTITIONER, "a component name")
    privacy = optional("privacy", None, "a privacy mechanism's name (e.g. \"dp-fixed\")")
    compression = optional("compression", None, "a compressor's name (e.g. \"quantize\")")
    broadcast = False
    if compression is not None and "broadcast" in compression.options:
        options = dict(compression.options)
        broadcast = options.pop("broadcast")
        if not isinstance(broadcast, bool):
            raise ConfigError(f"{path}: [compression] broadcast: expected true or false (send "
                              f"each worker a compressed delta of the model), got "
                              f"{broadcast!r}")
        compression = attrs.evolve(compression, options=options)
    clip_range = None
    if compression is not None and "clip_range" in compression.options:
        options = dict(compression.options)
        clip_range = options.pop("clip_range")
        if isinstance(clip_range, bool) or not isinstance(clip_range, (int, float)) \
                or not math.isfinite(clip_range) or clip_range <= 0:
            raise ConfigError(f"{path}: [compression] clip_range: expected a positive number "
                              f"(the shared grid [-clip_range, clip_range] every client "
                              f"quantises onto), got {clip_range!r}")
        clip_range = float(clip_range)
        compression = attrs.evolve(compression, options=options)
    residual = "coordinator"
    if compression is not None and "residual" in compression.options:
        options = dict(compression.options)
        residual = options.pop("residual")
        if residual not in ("coordinator", "worker"):
            raise ConfigError(f"{path}: [compression] residual: expected \"coordinator\" (error "
                              f"feedback's residual kept by the coordinator) or \"worker\" (kept "
                              f"by the worker that serves the client), got {residual!r}")
        compression = attrs.evolve(compression, options=options)
    attack = _attack_table(table("attack"), path) if "attack" in data else None
    secure = optional("secure_aggregation", DEFAULT_SECURE_AGGREGATION,
                      "a secure-aggregation scheme's name (e.g. \"secagg+\")")
    task = Selection("task", run.task, table("task"), "[task]")
    transport = Selection("transport", mesh.transport, table("transport"), "[transport]")
    observers = []
    for index, entry in enumerate(data.get("observers", [])):
        options = dict(entry)
        where = f"[[observers]] #{index + 1}"
        chosen = options.pop("name", None)
        if not isinstance(chosen, str) or not chosen:
            raise ConfigError(f"{path}: {where} name: expected an observer name (e.g. "
                              f"\"tensorboard\"), got {chosen!r}")
        observers.append(Selection("observer", chosen, options, where))
    return Config(path=path, run=run, mesh=mesh, task=task, transport=transport,
                  partitioner=partitioner, observers=tuple(observers), attack=attack,
                  privacy=privacy, simulation=simulation, secure_aggregation=secure,
                  compression=compression, compression_broadcast=broadcast,
                  compression_clip_range=clip_range, compression_residual=residual,
                  **selections)
