"""Everything ``meshkit run`` refuses before any process starts, decided once.

``meshkit run`` calls :func:`build_components` before it binds a socket or
spawns a worker, and ``meshkit check`` calls the same function, so the two
refuse the same configs: a check that says ok to a config the run then
rejects would only move the failure to a worse moment. In order:

1. the out directory can be created and written (:func:`check_out`);
2. the workers are driven as a star (through at most one local relay per
   worker) or as a full mesh with one address per rank
   (:func:`check_topology`, :func:`check_mesh_peers`), a run
   whose nodes start elsewhere has a readable secret of at least 16
   bytes (:func:`check_secret`), and a transport that authenticates
   nothing meets on loopback unless ``[mesh] trust_network``
   (:func:`check_transport_trust`, by its declared traits);
3. the strategy, the task and the strategy's own checks (a partition pinned
   to a rank the run will not have, a task lacking a method, ...);
4. the task's initial model is built on the coordinator
   (:func:`initial_model`), so a model that cannot fit in memory is a
   :class:`ConfigError` here rather than a ``MemoryError`` after workers
   were spawned;
5. the aggregator and the outer optimizer, and the ``[[observers]]``;
6. the ``[attack]``, when there is one: only a run with clients can have
   attackers, and the ones ``clients`` names must exist
   (:func:`attack_plan`).

What ``check`` prints about the plan is measured here too: the world the
run will really have (:func:`world_size`: the coordinator, the workers and
the fixed-function ranks) and the model's size (:class:`ModelSize`).
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import attrs
import numpy as np

from meshkit import plugins
from meshkit.attack import choose_attackers
from meshkit.aggregation import refuse_unless_linear
from meshkit.compression import check_model_keys, upload_estimate
from meshkit.errors import ConfigError, MeshError, RefusedError
from meshkit.options import structure_options
from meshkit.partitioner import (DEFAULT_PARTITIONER, is_lazy, is_per_node, label_counts,
                                 rows_of_client, split_rows)
from meshkit.population import client_rows_of, is_population
from meshkit.secure_aggregation import SchemeChoice
from meshkit.spill import check_spill, spill_dir
from meshkit.task import buffer_keys, build_task, check_task
from meshkit.train._attacks import AttackPlan
from meshkit.train._coordinator.compressing import compression_plan
from meshkit.train._coordinator.observers import build_observers
from meshkit.train._rounds.secure import secure_plan
from meshkit.train._sharding import shard_bounds
from meshkit.train._traits import strategy_traits
from meshkit.transport import transport_traits, trust_refusal

__all__ = ["build_components", "check_secure_aggregation", "check_out", "check_topology", "check_mesh_peers", "attack_plan",
           "check_secret", "initial_model", "world_size", "ModelSize", "ClientShare",
           "client_shares", "ClientShares", "run_clients"]


def check_out(cfg: Any) -> None:
    """Refuse an ``[run] out`` that cannot be created or written.

    Nothing is created: the nearest existing ancestor must be a directory
    this process may write into. (Root may write where permission bits say
    no; what the operating system still refuses then, the run reports as
    the same kind of error when it creates the directory.)
    """
    out = Path(cfg.run.out)
    where = f"{cfg.path}: [run] out = {cfg.run.out!r}"
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{where} is a file, not a directory; choose another out")
    probe = out.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{where}: {str(probe)!r} is a file, so no directory can be "
                          f"created inside it; choose another out")
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "is not writable" if probe == out.absolute() else (
            f"cannot be created: {str(probe)!r} is not writable")
        raise ConfigError(f"{where} {what} by this user; choose a directory you can write to")
    if cfg.run.spill:  # [run] spill_dir: OUT/spill unless set
        check_spill(spill_dir(out, cfg.run.spill_dir), f"{cfg.path}: [run] spill_dir")


def check_topology(cfg: Any, launch: str | None = None) -> None:
    """``meshkit run`` drives a star, or a full mesh over one address per rank.

    A mesh forms with every rank at once (each listens at its ``[mesh]
    peers`` entry and dials the lower ranks'), so what needs a rank to dial
    a coordinator it finds later (host relays, late joiners, discovery) is a
    star's alone.
    """
    relays = cfg.mesh.relays
    if relays > cfg.mesh.workers:
        raise ConfigError(
            f"{cfg.path}: [mesh] relays = {relays}, but there are {cfg.mesh.workers} "
            f"workers; a relay carries at least one worker, so use 1..{cfg.mesh.workers} "
            f"relays (or 0)")
    if cfg.mesh.topology == "star":
        if cfg.mesh.peers:
            raise ConfigError(
                f"{cfg.path}: [mesh] peers: only topology = \"mesh\" takes one address per "
                f"rank; a star's workers dial the coordinator's bind address. Remove peers, "
                f"or set topology = \"mesh\"")
        return
    star_only = [("relays", relays, "host relays carry a star's ranks to its coordinator"),
                 ("min_workers", cfg.mesh.min_workers,
                  "a mesh forms with every rank at once, so no rank joins late"),
                 ("discovery", cfg.mesh.discovery,
                  "a mesh's ranks are found at their [mesh] peers addresses"),
                 ("authorized_nodes", cfg.mesh.authorized_nodes,
                  "node keys are checked by a star's coordinator, and a mesh's workers would "
                  "take each other on the shared secret alone")]
    for key, value, why in star_only:
        if value:
            raise ConfigError(f"{cfg.path}: [mesh] {key} = {_toml(value)}: {why}; use "
                              f"topology = \"star\" for it, or drop {key}")
    if (launch or cfg.mesh.launch) != "local" and not cfg.mesh.peers:
        raise ConfigError(
            f"{cfg.path}: [mesh] peers: a mesh whose nodes start elsewhere needs one "
            f"host:port per rank, the coordinator's first (the nodes get the same list "
            f"with --peers); with launch = \"local\" meshkit picks loopback ports itself")


def check_mesh_peers(cfg: Any, world: int) -> None:
    """A mesh's ``[mesh] peers``, when given, has exactly one address per rank."""
    peers = cfg.mesh.peers
    if cfg.mesh.topology == "mesh" and peers and len(peers) != world:
        raise ConfigError(
            f"{cfg.path}: [mesh] peers: {len(peers)} address(es) for a world of {world} "
            f"(the coordinator, {cfg.mesh.workers} worker(s)"
            + (f" and {world - 1 - cfg.mesh.workers} board rank(s)"
               if world - 1 > cfg.mesh.workers else "")
            + "); give one host:port per rank, the coordinator's first")


def check_transport_trust(plan: Any) -> None:
    """A transport that authenticates nothing meets only on loopback, unless ``[mesh]
    trust_network`` (its declared traits; :func:`meshkit.transport.trust_refusal`)."""
    cfg = plan.config
    why = trust_refusal(cfg.mesh.transport, transport_traits(plan.components["transport"].options),
                        plan.options["transport"], rank=0, bind=cfg.mesh.bind,
                        peers=tuple(cfg.mesh.peers), trust_network=cfg.mesh.trust_network)
    if why is not None:
        raise ConfigError(f"{cfg.path}: {why}")


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"\"{value}\"" if isinstance(value, str) else str(value)


def check_secret(cfg: Any, launch: str | None = None) -> None:
    """Nodes started elsewhere need the shared secret: refuse a missing or short one.

    A local launch makes a fresh secret per run, so only ``"external"``
    (``[mesh] launch``, or ``meshkit coordinator`` forcing it) reads it.
    """
    if (launch or cfg.mesh.launch) == "local" and cfg.mesh.authorized_nodes:
        raise ConfigError(
            f"{cfg.path}: [mesh] authorized_nodes: admits nodes started elsewhere with "
            f"`meshkit node --key`; the workers launch = \"local\" spawns have no keys. Use "
            f"launch = \"external\" (or `meshkit coordinator`), or drop authorized_nodes")
    if (launch or cfg.mesh.launch) == "local":
        return
    if cfg.secret() is None:  # reads secret_file: unreadable or short is refused there
        raise ConfigError(
            f"{cfg.path}: [mesh] secret_file: nodes started elsewhere must share a "
            f"secret with the coordinator; set secret_file or MESHKIT_SECRET")
    cfg.authorized_nodes()  # a missing, malformed or world-readable file is refused here


def initial_model(task: Any, cfg: Any) -> dict[str, Any]:
    """The task's initial model from the run seed, or a ConfigError saying why not."""
    try:
        return dict(task.init_state(cfg.run.seed))
    except MemoryError as exc:
        raise ConfigError(
            f"{cfg.path}: [task]: the initial model of task {cfg.run.task!r} does not fit in "
            f"this machine's memory ({exc}); check the [task] options that size the model "
            f"(e.g. hidden)") from None
    except MeshError:
        raise
    except Exception as exc:
        raise ConfigError(
            f"{cfg.path}: [run] task: {cfg.run.task!r}: init_state(seed={cfg.run.seed}) raised "
            f"{type(exc).__name__}: {exc}") from exc


@attrs.frozen
class ModelSize:
    """How big a state is: its array leaves' elements and bytes, and its other keys."""

    parameters: int
    nbytes: int
    arrays: int
    values: int

    @classmethod
    def of(cls, state: Mapping[str, Any]) -> ModelSize:
        arrays = [v for v in state.values() if isinstance(v, np.ndarray)]
        return cls(parameters=sum(int(a.size) for a in arrays),
                   nbytes=sum(int(a.nbytes) for a in arrays), arrays=len(arrays),
                   values=len(state) - len(arrays))

    def describe(self) -> str:
        text = (f"{self.parameters:,} parameters in {self.arrays} array(s), "
                f"{_bytes(self.nbytes)}")
        return text + (f", and {self.values} other value(s)" if self.values else "")

    def to_json(self) -> dict[str, int]:
        return attrs.asdict(self)


def _bytes(n: int) -> str:
    size = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{n} bytes" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} bytes"  # pragma: no cover


@attrs.frozen
class ClientShare:
    """One client of a simulated federation: its examples and its examples per label."""

    client: int
    examples: int
    labels: Mapping[Any, int]

    def describe(self) -> str:
        counts = " ".join(f"{k}:{n}" for k, n in self.labels.items())
        return f"client {self.client}: {self.examples} examples; labels {counts}"

    def to_json(self) -> dict[str, Any]:
        return {"client": self.client, "examples": self.examples,
                "labels": {str(k): n for k, n in self.labels.items()}}


#: A split of at most this many clients is computed whole by ``check`` (and
#: shown client by client); a larger one is summarised from a sample.
CHECK_EVERY_CLIENT = 1000
#: How many clients a larger split's summary computes (seeded by the run seed).
SUMMARY_SAMPLE = 100


def run_clients(cfg: Any, strategy: Any, partitioner: Any, task: Any) -> int:
    """How many clients the run has, as the strategy counts them (a population's size)."""
    count = strategy_traits(strategy).count_clients
    if count is None:
        return int(cfg.mesh.workers)
    if is_population(task):
        return int(count(cfg.mesh.workers, partitioner, task))
    return int(count(cfg.mesh.workers, partitioner))


@attrs.frozen
class ClientShares:
    """What ``check`` says about the clients: each one's share, or a seeded sample's.

    ``sampled`` is empty when ``shares`` holds every client, else it says
    which clients were computed and why the others were not.
    """

    count: int
    shares: tuple[ClientShare, ...]
    source: str
    sampled: str = ""

    def summary(self) -> str:
        """The examples per client over ``shares``: min, median, max."""
        examples = sorted(share.examples for share in self.shares)
        if not examples:
            return ""
        return (f"examples per client min {examples[0]}, median "
                f"{examples[len(examples) // 2]}, max {examples[-1]}")


def client_shares(cfg: Any, strategy: Any, task: Any, partitioner: Any
                  ) -> ClientShares | None:
    """The split every worker will compute, computed here (so ``check`` shows it and
    refuses a split that cannot be made); None with ``local`` (each node's own data).

    A population (:mod:`meshkit.population`) or a split of more than
    :data:`CHECK_EVERY_CLIENT` clients is summarised from
    :data:`SUMMARY_SAMPLE` clients drawn with the run seed, each computed
    alone (a lazy partitioner's ``client_rows``, a population's
    ``client_data``); an eager partitioner's split is still computed whole
    once, since that is what its workers compute.
    """
    if is_per_node(partitioner):
        return None
    clients = run_clients(cfg, strategy, partitioner, task)
    name = cfg.partitioner_name
    try:
        if is_population(task):
            chosen = _sample(clients, cfg.run.seed)
            shares = []
            for c in chosen:
                _, labels = _population_rows(task, c, clients, cfg)
                shares.append(_share(c, labels, np.arange(len(labels))))
            return ClientShares(clients, tuple(shares), source="the task's population",
                                sampled=_sampled_note(len(chosen), clients, "made"))
        _, labels = task.train_data()
        labels = np.asarray(labels)
        source = f"[partitioner] {name}"
        if clients <= CHECK_EVERY_CLIENT or (partitioner is not None and not is_lazy(partitioner)):
            if partitioner is None:  # no [partitioner]: the kernel's contiguous blocks
                parts = [np.arange(a, b) for a, b in shard_bounds(len(labels), clients)]
            else:
                parts = split_rows(partitioner, labels, clients, seed=cfg.run.seed, name=name)
            if clients <= CHECK_EVERY_CLIENT:
                return ClientShares(clients, tuple(_share(c, labels, rows)
                                                   for c, rows in enumerate(parts)), source)
            chosen = _sample(clients, cfg.run.seed)
            return ClientShares(clients, tuple(_share(c, labels, parts[c]) for c in chosen),
                                source, sampled=_sampled_note(len(chosen), clients, "shown"))
        chosen = _sample(clients, cfg.run.seed)
        if partitioner is None:
            bounds = shard_bounds(len(labels), clients)
            rows_of = {c: np.arange(*bounds[c]) for c in chosen}
        else:
            rows_of = {c: rows_of_client(partitioner, labels, clients, c, seed=cfg.run.seed,
                                         name=name) for c in chosen}
        return ClientShares(clients, tuple(_share(c, labels, rows_of[c]) for c in chosen),
                            source, sampled=_sampled_note(len(chosen), clients, "computed"))
    except ConfigError as exc:
        raise ConfigError(f"{cfg.path}: {exc}") from None


def _population_rows(task: Any, client: int, clients: int, cfg: Any) -> tuple[Any, Any]:
    """A population's client ``client``'s rows, or a ConfigError naming [task] (as
    :func:`initial_model` does for the model): a size the task made from its options
    that cannot be allocated is the config's to fix, not a traceback."""
    try:
        return client_rows_of(task, client, clients)
    except MeshError:
        raise
    except MemoryError as exc:
        raise ConfigError(
            f"[task]: client {client}'s data of task {cfg.run.task!r} does not fit in this "
            f"machine's memory ({exc}); check the [task] options that size it") from None
    except Exception as exc:
        raise ConfigError(
            f"[task]: task {cfg.run.task!r}: client_data({client}) raised "
            f"{type(exc).__name__}: {exc}") from exc


def _sample(clients: int, seed: int) -> list[int]:
    """At most SUMMARY_SAMPLE clients, drawn with the run seed (O(sample), not O(clients))."""
    if clients <= SUMMARY_SAMPLE:
        return list(range(clients))
    rng = np.random.default_rng([seed, 0xC11E])
    return sorted(int(c) for c in rng.choice(clients, size=SUMMARY_SAMPLE, replace=False))


def _sampled_note(sampled: int, clients: int, how: str) -> str:
    if sampled >= clients:
        return ""
    return (f"{sampled} of {clients} clients {how} (drawn with the run seed), each alone; the "
            f"others are not computed here")


def _share(client: int, labels: np.ndarray, rows: np.ndarray) -> ClientShare:
    return ClientShare(client, len(rows), label_counts(labels, [rows])[0])


def attack_plan(plan: Any, strategy: Any, partitioner: Any,
                task: Any = None) -> AttackPlan | None:
    """The run's ``[attack]``: the attack built and its clients chosen (None: no table)."""
    cfg = plan.config
    if cfg.attack is None:
        return None
    if not strategy_traits(strategy).partitioned:
        raise ConfigError(
            f"{cfg.path}: [attack]: strategy {cfg.strategy.name!r} has no clients to make "
            f"Byzantine (it lacks the trait StrategyTraits.partitioned); remove the [attack] table, or poison one node with "
            f"`meshkit node --attack NAME`")
    clients = run_clients(cfg, strategy, partitioner, task)
    attackers = choose_attackers(clients, explicit=cfg.attack.clients,
                                 fraction=cfg.attack.fraction, seed=cfg.run.seed,
                                 where=f"{cfg.path}: [attack]")
    return AttackPlan(name=cfg.attack.selection.name, options=dict(cfg.attack.selection.options),
                      attack=plan.create("attack"), clients=attackers, seed=cfg.run.seed)


def check_boards(cfg: Any, boards: Sequence[tuple[str, Mapping[str, Any]]]) -> None:
    """Every fixed-function rank's board is offered by a plugin and its options fit the
    board's options class, as ``meshkit node --board`` will structure them.

    Checked here, so a misspelt option is the board's one-line error before
    anything starts, not a node that exits while the coordinator waits for its
    capability handshake. The board itself is not built: its driver may need
    hardware only its node has.
    """
    registry = plugins.default().registry
    for index, (name, options) in enumerate(boards):
        where = f"[[strategy.boards]] #{index + 1}"
        try:
            component = registry.get("board", name)
        except MeshError as exc:
            raise type(exc)(f"{cfg.path}: {where} board = {name!r}: {exc}") from None
        try:
            structure_options(component, options, where=f"{where} ({name}) options")
        except MeshError as exc:
            raise ConfigError(f"{cfg.path}: {exc}") from None


def world_size(cfg: Any, boards: list[Any]) -> int:
    """Ranks the run has: the coordinator, ``[mesh] workers`` and each fixed-function board."""
    return cfg.mesh.workers + len(boards) + 1


def check_privacy(cfg: Any, strategy: Any, aggregator: Any) -> None:
    """Refuse a [privacy] table with a strategy or aggregator that would break its guarantee."""
    traits = strategy_traits(strategy)
    if not traits.private:
        raise RefusedError(
            f"{cfg.path}: [privacy] name = {cfg.privacy.name!r} with [strategy] name = "
            f"{cfg.strategy.name!r}: only a strategy that plays private rounds can clip, "
            f"noise and account them, and {traits.lacks('private')}. Use a strategy that "
            f"declares it (federated), or remove the [privacy] table")
    # The noised sum is the round's aggregate; a rule that is not a weighted mean
    # would either be ignored or, applied to the noised contributions, discard
    # some of them after the noise was calibrated to all.
    refuse_unless_linear(
        aggregator,
        where=(f"{cfg.path}: [privacy] name = {cfg.privacy.name!r} with [aggregator] name = "
               f"{cfg.aggregator.name!r}"),
        needs=("a private round releases one noised sum of clipped updates, each client "
               "counting once, in place of the aggregator's mean"),
        instead=_private_instead(cfg))


def _private_instead(cfg: Any) -> str:
    """What works instead of a non-linear aggregator under ``[privacy]``: with
    ``[secure_aggregation]`` too, only what both accept (a robust rule such as
    norm-bound would be refused by the secure round next)."""
    if cfg.secure_aggregation is None:
        return ("Use a linear aggregator (fedavg; [privacy] clip_norm already bounds each "
                "update), or remove the [privacy] table")
    return (f"With [secure_aggregation] name = {cfg.secure_aggregation.name!r} as well, use "
            f"a linear aggregator (fedavg), the one kind both accept: [privacy] clip_norm "
            f"bounds each update on the clients (clip = \"client\") and the secure round "
            f"sums them; or remove the [privacy] table")


def check_secure_aggregation(cfg: Any, strategy: Any, aggregator: Any) -> None:
    """Refuse what a ``[secure_aggregation]`` round cannot honour (docs/secure-aggregation.md).

    Each refusal names both keys and what works instead. The rule behind
    them: the coordinator learns the round's sum of masked, quantised updates
    and who answered -- nothing it could tell one client's update from.
    """
    where = f"{cfg.path}: [secure_aggregation] name = {cfg.secure_aggregation.name!r} with"
    traits = strategy_traits(strategy)
    if not traits.secure:
        # fedbuff folds updates one by one as they come; data-parallel, local and
        # model-parallel have no cohort of clients whose sum alone is needed.
        raise RefusedError(
            f"{where} [strategy] name = {cfg.strategy.name!r}: only a strategy that plays "
            f"synchronous rounds of client fits whose sum is all it needs can run them "
            f"masked, and {traits.lacks('secure')}. Use a strategy that declares it "
            f"(federated), or remove the [secure_aggregation] table")
    refuse_unless_linear(
        aggregator, where=f"{where} [aggregator] name = {cfg.aggregator.name!r}",
        needs=("a secure round reveals only the sum of the clients' masked updates (never an "
               "individual update or its norm), and the mean is that sum over the surviving "
               "clients, each counting once"),
        instead="Use a linear aggregator (fedavg), or remove the [secure_aggregation] table")
    evaluate = traits.evaluate
    if evaluate != "coordinator":
        raise RefusedError(
            f"{where} [strategy] evaluate = {evaluate!r}: each client's own metrics would "
            f"reach the coordinator (and metrics.jsonl) in clear, individual values a "
            f"secure round withholds. Use evaluate = \"coordinator\"")
    local_keys = traits.local_keys
    if local_keys:
        raise RefusedError(
            f"{where} [strategy] local_keys = {list(local_keys)}: FedBN keeps each "
            f"client's own values of those keys at the coordinator, individual values a "
            f"secure round never reveals. Remove local_keys (or the [secure_aggregation] "
            f"table)")
    if traits.trainable:
        raise RefusedError(
            f"{where} [strategy] trainable = {list(traits.trainable)}: a secure round masks "
            f"and sums every key of the model each round, and sending only the trainable "
            f"keys is not built into it yet. Remove trainable (or the [secure_aggregation] "
            f"table)")
    timeout = traits.round_timeout
    if timeout:
        raise RefusedError(
            f"{where} [strategy] round_timeout = {timeout:g}: a secure round "
            f"has no deadline yet (a late client would have to be unmasked as a dropout, "
            f"which meshkit does not do). Remove round_timeout; a lost worker's clients are "
            f"dropouts the protocol survives")
    if cfg.attack is not None:
        raise RefusedError(
            f"{where} [attack] name = {cfg.attack.selection.name!r}: simulated attacks "
            f"poison single contributions at the coordinator, or are named per client in "
            f"clear, neither of which a secure round has. Start a node with `meshkit node "
            f"--attack NAME` instead (its fits are masked like any other), or remove the "
            f"[attack] table")


def check_secure_privacy(cfg: Any, privacy: Any) -> None:
    """``[privacy]`` under ``[secure_aggregation]``: only fixed clipping on the clients."""
    where = f"{cfg.path}: [secure_aggregation] name = {cfg.secure_aggregation.name!r} with"
    # Every change the combination needs, in one refusal: fixing one and being
    # refused for the next is the slow way to learn what works.
    placement = getattr(privacy, "placement", "coordinator")
    problems: list[str] = []
    fixes: list[str] = []
    if placement != "client":
        problems.append(f"[privacy] clip = {placement!r}: the coordinator never holds an "
                        f"individual update, so it cannot clip one")
        fixes.append("clip = \"client\"")
    if getattr(privacy, "adaptive", None) is not None:
        problems.append(f"[privacy] name = {cfg.privacy.name!r}: adaptive clipping counts the "
                        f"clients whose update was within the clip norm, one bit per client "
                        f"the coordinator would read in clear")
        fixes.insert(0, "name = \"dp-fixed\"")
    if problems:
        raise RefusedError(f"{where} " + "; and ".join(problems) + ". Use [privacy] "
                           + " with ".join(fixes) + " (fixed clipping on the clients, the "
                           "private secure combination meshkit runs)")


def check_distributed(cfg: Any, privacy: Any) -> None:
    """``[privacy] placement = "distributed"``: the noise is added in the secure aggregation's
    field, so it needs ``[secure_aggregation]``, and that field holds the Skellam grid alone."""
    if getattr(privacy, "noise_placement", "central") != "distributed":
        return
    where = f"{cfg.path}: [privacy] name = {cfg.privacy.name!r} with placement = \"distributed\""
    if cfg.secure_aggregation is None:
        raise RefusedError(
            f"{where}: the clients add their shares of the noise before their updates are "
            f"masked, and without [secure_aggregation] each update would reach the "
            f"coordinator with only its own small share of noise. Add [secure_aggregation] "
            f"name = \"secagg+\", or use placement = \"central\" (the coordinator adds the "
            f"noise to the sum)")
    if cfg.compression is not None:
        raise RefusedError(
            f"{where} and [compression] name = {cfg.compression.name!r}: the clients put "
            f"their updates on the Skellam mechanism's integer grid, which is itself the "
            f"quantisation, and the compressor's codes would be a second grid in the same "
            f"field. Drop [compression] and narrow the field instead ([secure_aggregation] "
            f"modulus_bits: the Skellam grid fills whatever width it is given), or use "
            f"placement = \"central\"")


#: The most rounds a ``[privacy]`` run may have (what its ε accounting can compose).
MAX_PRIVATE_ROUNDS = 100_000


def privacy_plan(cfg: Any, strategy: Any, privacy: Any, partitioner: Any,
                 rounds: int | None, task: Any = None) -> dict[str, Any] | None:
    """What a private run will spend: q, m and ε after every configured round."""
    if privacy is None:
        return None
    rate = strategy_traits(strategy).sampling_rate
    clients = run_clients(cfg, strategy, partitioner, task)
    q = float(rate(clients)) if rate is not None else 1.0
    total = int(rounds or 0)
    if total > MAX_PRIVATE_ROUNDS:
        # The PLD accountant's grid grows with the rounds it composes (at 2**63
        # it would ask for exabytes); no private run needs that many.
        raise ConfigError(
            f"{cfg.path}: [strategy] rounds = {total}: a private run's accountant composes "
            f"at most {MAX_PRIVATE_ROUNDS:,} rounds; use fewer rounds")
    eps = privacy.epsilon_after(q, total) if total else 0.0
    plan: dict[str, Any] = {"q": q, "expected_cohort": q * clients, "rounds": total,
                            "epsilon": eps, "delta": privacy.delta,
                            "target_epsilon": privacy.target_epsilon}
    if privacy.target_epsilon and eps > privacy.target_epsilon:
        low, high = 0, total  # the most rounds within the budget, by bisection
        while low < high:
            mid = (low + high + 1) // 2
            if privacy.epsilon_after(q, mid) <= privacy.target_epsilon:
                low = mid
            else:
                high = mid - 1
        plan["rounds_within_target"] = low
    return plan


def build_components(plan: Any, *, launch: str | None = None) -> dict[str, Any]:
    """Build every component of a resolved plan and run every start-up check.

    Used by ``meshkit run`` before any process starts and by ``meshkit check``,
    so both refuse the same configs. ``launch`` overrides ``[mesh] launch``
    (``meshkit coordinator`` forces ``"external"``). Every refusal names the
    config file: a component's or strategy's own message (which knows its
    table and key, not the file) gets the file put in front.
    """
    try:
        return _build_components(plan, launch=launch)
    except MeshError as exc:
        raise naming_the_file(exc, plan.config.path) from exc.__cause__


def naming_the_file(exc: MeshError, path: str) -> MeshError:
    """``exc`` as it is when its message names the config ``path``, else the same kind
    of error with ``path: `` in front (a :class:`ConfigError` when that kind cannot
    be made from a message alone)."""
    text = str(exc)
    if text.startswith(f"{path}:") or f"{path}: " in text:
        return exc
    try:
        named = type(exc)(f"{path}: {text}")
    except TypeError:  # an error class whose constructor takes more than a message
        named = ConfigError(f"{path}: {text}")
    if str(named) != f"{path}: {text}":
        named = ConfigError(f"{path}: {text}")
    return named


def _build_components(plan: Any, *, launch: str | None = None) -> dict[str, Any]:
    cfg = plan.config
    check_out(cfg)
    check_topology(cfg, launch)
    check_secret(cfg, launch)
    check_transport_trust(plan)
    if cfg.mesh.relays and (launch or cfg.mesh.launch) != "local":
        raise ConfigError(
            f"{cfg.path}: [mesh] relays = {cfg.mesh.relays} starts host relays on this "
            f"machine for a local launch; with nodes started elsewhere, start `meshkit relay` "
            f"on each of their hosts instead (docs/scaling-out.md) and drop relays")
    strategy = plan.create("strategy")
    if not callable(getattr(strategy, "run", None)):
        raise ConfigError(f"{cfg.path}: [strategy] {cfg.strategy.name!r} built a "
                          f"{type(strategy).__name__} with no run(ctx) method")
    try:
        task = check_task(build_task(plan.components["task"], plan.options["task"],
                                     cfg.run.task), cfg.run.task)
    except ConfigError as exc:
        raise ConfigError(f"{cfg.path}: [run] task: {exc}") from exc
    traits = strategy_traits(strategy)
    partitioner = plan.create("partitioner") if cfg.partitioner is not None else None
    partitioned = traits.partitioned
    if is_population(task) and cfg.partitioner is not None:
        # No option that silently does nothing: a population has no one set to split.
        raise ConfigError(
            f"{cfg.path}: [partitioner] name = {cfg.partitioner_name!r}: the task "
            f"{cfg.run.task!r} is a population, whose clients' data it makes itself, client by "
            f"client; there is no training set to split. Remove the [partitioner] table")
    if not partitioned and cfg.partitioner_name != DEFAULT_PARTITIONER:
        # No option that silently does nothing: only a federated run has clients.
        raise ConfigError(
            f"{cfg.path}: [partitioner] name = {cfg.partitioner_name!r}: strategy "
            f"{cfg.strategy.name!r} does not split the training set into clients (it lacks "
            f"the trait StrategyTraits.partitioned; federated has it); remove the "
            f"[partitioner] table")
    aggregator = plan.create("aggregator")
    privacy = plan.create("privacy") if cfg.privacy is not None else None
    if privacy is not None:
        check_privacy(cfg, strategy, aggregator)
        check_distributed(cfg, privacy)
    speeds = cfg.speeds()
    if speeds is not None and not traits.clocked:
        # No option that silently does nothing: only a strategy that orders
        # arrivals by the clock has any use for it.
        raise ConfigError(
            f"{cfg.path}: [simulation]: strategy {cfg.strategy.name!r} does not run on the "
            f"virtual clock: it lacks the trait StrategyTraits.clocked (fedbuff has it: it folds updates in the order their simulated "
            f"fits finish); remove the [simulation] table, or use [strategy] name = "
            f"\"fedbuff\"")
    secure = scheme = None
    if cfg.secure_aggregation is not None:
        check_secure_aggregation(cfg, strategy, aggregator)
        if privacy is not None:
            check_secure_privacy(cfg, privacy)
        scheme = SchemeChoice(cfg.secure_aggregation.name, plan.create("secure_aggregation"))
    # Built before the strategy's check, which may refuse a compressor it cannot play, and
    # before the secure plan, whose field a compressor's codes narrow.
    compression = compression_plan(plan, strategy, privacy, scheme)
    if scheme is not None:
        secure = secure_plan(scheme,
                             run_clients(cfg, strategy, partitioner, task), cfg.mesh.workers,
                             # Poisson sampling may draw every client in one round.
                             fraction=1.0 if traits.sampling == "poisson" else traits.fraction,
                             min_clients=traits.min_clients, path=cfg.path,
                             compression=compression)
    # Built before the strategy's check, which may refuse an attack it cannot play.
    attack = attack_plan(plan, strategy, partitioner, task)
    check = traits.check
    if check is not None:
        extra: dict[str, Any] = {"partitioner": partitioner} if partitioned else {}
        if privacy is not None:
            extra["privacy"] = privacy
        # What a strategy's check may ask for by naming it (fedbuff refuses
        # what it cannot compose with).
        wants = inspect.signature(check).parameters
        for name, value in (("speeds", speeds), ("aggregator", aggregator),
                            ("attack", attack), ("compression", compression)):
            if name in wants:
                extra[name] = value
        try:
            check(task=task, outer_name=cfg.outer_optimizer.name, workers=cfg.mesh.workers,
                  **extra)
        except ConfigError as exc:
            raise ConfigError(f"{cfg.path}: {exc}") from None
    shares = client_shares(cfg, strategy, task, partitioner) if partitioned else None
    state = initial_model(task, cfg)
    upload = None
    if compression is not None:
        check_model_keys(state, f"{cfg.path}: [compression]")
        upload = upload_estimate(compression, state, buffer_keys(task))
    # None: the strategy has no rounds option (only a declared 0 means
    # "evaluate only").
    rounds = traits.rounds
    boards = list(traits.extra_ranks)
    check_boards(cfg, boards)
    world = world_size(cfg, boards)
    check_mesh_peers(cfg, world)
    return {
        "boards": boards,
        "world": world,
        "model": ModelSize.of(state),
        "strategy": strategy,
        "task": task,
        "partitioner": partitioner,
        #: Each client's examples and labels, or a sample's (:class:`ClientShares`;
        #: None: each node's own data, unknown here).
        "clients": shares,
        "aggregator": aggregator,
        #: ``[attack]``: the simulated Byzantine clients (None: every client honest).
        "attack": attack,
        "outer": plan.create("outer_optimizer"),
        "privacy": privacy,
        #: ``[compression]``: the run's :class:`meshkit.compression.CompressionPlan`, or None.
        "compression": compression,
        #: What one client's compressed upload carries (:func:`upload_estimate`), or None.
        "upload": upload,
        #: ``[secure_aggregation]``: the selected scheme
        #: (:class:`meshkit.secure_aggregation.SchemeChoice`), or None.
        "secure_aggregation": scheme,
        #: A secure run's cohort, graph and how many workers a round survives losing
        #: (:func:`meshkit.train._rounds.secure.secure_plan`), else None.
        "secure_plan": secure,
        #: (q, ε after every configured round) of a private run, else None.
        "privacy_plan": privacy_plan(cfg, strategy, privacy, partitioner, rounds, task),
        #: ``[[observers]]``: a plugin set of their own (:mod:`meshkit.train._coordinator.observers`).
        "observers": build_observers(plan),
        "rng": np.random.default_rng(cfg.run.seed),
        #: ``[simulation]``: the clients' durations on the virtual clock (None: real time).
        "speeds": speeds,
        "rounds": None if rounds is None else int(rounds),
        # The model the checks built: resume compares shapes with it and an
        # evaluation-only run evaluates it. A training run lets it go before
        # starting (the strategy builds it again, the same pure function of
        # the seed), so the coordinator holds no extra copy for the run.
        "initial_state": state,
        "ctx_state": None,
        "global_state": None,
        #: Clients not tried again in this run (a resumed run's, from its checkpoint).
        "stalled_clients": {},
    }
