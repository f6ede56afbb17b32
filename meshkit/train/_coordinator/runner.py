"""Running a training job from one config: the coordinator side of ``meshkit run``.

Order of events (:meth:`Runner.run`):

1. Resolve the config (a path, a mapping or a parsed :class:`Config`), build
   the task, strategy, aggregator and outer optimizer and the initial model,
   and run every start-up check (:mod:`meshkit.train._coordinator.preflight`, which
   ``meshkit check`` shares). Then decide what the out directory allows
   (:mod:`meshkit.train._coordinator.resume`): a fresh run never replaces another run's
   checkpoint without ``overwrite``; ``resume`` continues one, and a run
   whose checkpoint covers every round is already complete (nothing
   starts). Every refusal here happens before any process starts or any
   socket opens.
2. ``meshkit_run_started(config)`` fires.
3. ``rounds = 0`` evaluates the initial model (or the one a strategy serves,
   model-parallel's ``state_from``, named by its ``loaded_state()``) on the
   coordinator, records it as round 0 and ends: no worker is needed.
4. Otherwise the coordinator (rank 0) binds ``[mesh] bind``. With
   ``launch = "local"`` it spawns ``workers`` local processes with a fresh
   per-run secret (:mod:`meshkit.train._coordinator.launch`); with ``"external"`` it
   waits for nodes started elsewhere with ``meshkit node`` and the
   configured secret.
5. Workers announce their capabilities; each one that can train (and has
   the device ``[strategy] device`` requires, if any: no such rank is a
   :class:`PlacementError` before any work moves) is sent a ``train`` job
   (:mod:`meshkit.train._worker.trainer` documents the spec). With ``[mesh]
   min_workers`` the run starts once that many have joined. Between rounds
   the coordinator takes in the workers that joined since: late ones, and
   restarted ones the transport let back (``group.take_back()``): each
   announces its capabilities again and is sent the job (:meth:`Runner._admit`).
6. The strategy runs. After each round: an atomic checkpoint
   (:mod:`meshkit.checkpoint`), then one line appended (and flushed) to
   ``OUT/metrics.jsonl`` recording who answered, then the progress callback
   and ``meshkit_round_completed(report)``. With ``heartbeat`` set, a round
   that takes longer than that is reported alive every ``heartbeat``
   seconds (an ``"alive"`` event).
7. Whatever happened, workers are stopped (local ones terminated),
   ``OUT/summary.json`` is written, ``OUT/report.png`` is drawn when
   matplotlib is installed (:mod:`meshkit.train._coordinator.artifacts`), and
   ``meshkit_run_finished(report)`` fires.

A failure (a worker error, too few survivors, Ctrl-C or SIGTERM raised as
:class:`Interrupted`) leaves the last checkpoint intact; ``--resume``
continues from it.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import attrs
import numpy as np

from meshkit import plugins
from meshkit.aggregation import aggregator_state
from meshkit.checkpoint import Checkpoint, save_checkpoint
from meshkit.config import Config, load_config, parse_config
from meshkit.train._coordinator.plan import resolve
from meshkit.errors import (AuthenticationError, ConfigError, MeshError, PeerLostError,
                            PlacementError, RefusedError, WorkerError)
from meshkit.node import collect_caps, receive_caps, refuse_node, send_job, shutdown_nodes
from meshkit.node.config import NodeConfig
from meshkit.partitioner import is_per_node
from meshkit.population import is_population
from meshkit.task import importing_script
from meshkit.pipeline import Stage, run_pipeline
from meshkit.train._coordinator.artifacts import (append_clients, append_metrics, plot, split_clients,
                                      write_summary)
from meshkit.train._coordinator.launch import (ExitWatch, exited_early, logs_dir, loopback_peers,
                                               mesh_bind, new_secret, reap, spawn_workers,
                                               write_secret)
from meshkit.train._local_keys import ClientLocal
from meshkit.train._coordinator.report import Interrupted, RunEvent, RunReport
from meshkit.train._partitions import WorkerIdentity
from meshkit.train._rounds.collective import check_collective
from meshkit.train._traits import strategy_traits
from meshkit.train._pool import GroupPool, LocalPool
from meshkit.train._worker.trainer import _trainer
from meshkit.train._coordinator.preflight import build_components
from meshkit.train._coordinator.resume import Start, identity, prepare_out
from meshkit.train._strategy import REPORT_FIELDS, RoundReport, StrategyContext

__all__ = ["RunReport", "RunEvent", "Runner", "Interrupted", "run", "load_run_config"]

log = logging.getLogger(__name__)


def load_run_config(config: Any) -> Config:
    """A run's config from a path, a mapping (a TOML document's tables) or a :class:`Config`."""
    if isinstance(config, Config):
        return config
    if isinstance(config, Mapping):
        return parse_config(config, path="<mapping>")
    return load_config(config)


@attrs.define
class Runner:
    """One run; :func:`run` is the usual entry point.

    ``config`` is a path, a mapping or a parsed :class:`Config`. ``resume``
    continues from the out directory's checkpoint; ``overwrite`` replaces a
    checkpoint a fresh run finds there (without it, that is refused).
    ``progress(event)`` receives :class:`RunEvent` records (the CLI renders
    them; "alive" events come from a timer thread). ``heartbeat`` is the
    seconds between "alive" events of a long round (None: no events).
    ``launch`` overrides ``[mesh] launch`` (``meshkit coordinator`` forces
    "external"). ``on_workers(processes)`` is called with the local worker
    ``Popen`` objects by rank once they are spawned (tests use it to inject
    faults).
    """

    config: Any
    resume: bool = False
    pset: Any = None
    progress: Callable[[RunEvent], None] | None = None
    launch: str | None = None
    #: Start the discovery responder whatever ``[mesh] discovery`` says (``--discovery``).
    discovery: bool = False
    on_workers: Callable[[Mapping[int, subprocess.Popen]], None] | None = None
    #: A collective run (:class:`meshkit.train.PartialReducer`): no coordinator and no
    #: worker processes; this process plays its slice of every round
    #: (:mod:`meshkit.train._rounds.collective`). None: the usual coordinator.
    collective: Any = None
    on_round: Callable[[Any, Mapping[str, Any]], None] | None = None
    overwrite: bool = False
    heartbeat: float | None = None
    stop: threading.Event = attrs.Factory(threading.Event)
    processes: dict[int, subprocess.Popen] = attrs.Factory(dict)
    #: True once the run is stopping its workers and writing its results: an
    #: interrupt then would only leave workers behind (the CLI ignores one).
    finishing: bool = False
    #: How the run ended, once it has (also when run() raised): summary.json's content.
    report: RunReport | None = None
    _tmpdir: str | None = None
    _group: Any = None
    _world: int = 0
    _caps: list[Any] = attrs.Factory(list)
    _boards: dict[int, str] = attrs.Factory(dict)
    #: Ranks that asked to be sent the training set (``--pull-data``).
    _pull: set[int] = attrs.Factory(set)
    #: The plan and built components, once the run has them (the pulled data's source).
    _plan_parts: Any = None
    #: ``[mesh] authorized_nodes``, parsed at join (None: keys bind no tags).
    _authorized: Any = None
    _timeout: float | None = None
    _out: str = "."
    _round_started: float = 0.0
    #: The rounds played so far (RunReport.history).
    _history: list[Any] = attrs.Factory(list)
    #: ``[strategy] device``: training is placed only on ranks that have it ("" = any).
    _device: str = ""
    #: Ranks that joined late but cannot train here (not asked again).
    _left_out: set[int] = attrs.Factory(set)
    _join_timeout: float = 60.0
    #: The run's ``[[observers]]`` (a plugin set of their own), once built.
    _observers: Any = None

    @property
    def address(self) -> str:
        """Where the coordinator listens, once it does ("" before; what "listening" announces)."""
        return str(self._group.address) if self._group is not None else ""

    # -- entry ----------------------------------------------------------------

    def run(self) -> RunReport:
        script = importing_script()
        if script:
            raise RefusedError(
                f"{script} calls meshkit.run when it is imported, and a worker imports it to "
                f"find your task: put the call under if __name__ == \"__main__\": (as "
                f"multiprocessing asks) so that it runs only when you run the script")
        if self.resume and self.overwrite:
            raise ConfigError("resume and overwrite exclude each other: --resume continues the "
                              "out directory's checkpoint, --overwrite replaces it")
        config = load_run_config(self.config)
        pset = self.pset if self.pset is not None else plugins.default()
        plan = resolve(config, pset)
        parts = build_components(plan, launch=self.launch)
        if self.collective is not None:  # what a collective round cannot play, refused now
            check_collective(strategy=config.strategy.name, aggregator=parts["aggregator"],
                             privacy=parts["privacy"], attack=parts.get("attack"),
                             partitioner_local=is_per_node(parts["partitioner"]),
                             traits=strategy_traits(parts["strategy"]),
                             where=str(config.path), task=parts["task"])
        self._device = strategy_traits(parts["strategy"]).device
        self._join_timeout = config.mesh.join_timeout
        self._observers = parts["observers"]
        out = Path(config.run.out)
        self._out = str(out)
        start = prepare_out(plan, parts, resume=self.resume, overwrite=self.overwrite)
        if start.complete:
            return _already_complete(config, parts, start)
        if parts["rounds"] != 0:
            parts["initial_state"] = None  # the strategy builds its own (see _preflight)
        self._notify(pset, "meshkit_run_started", config=config)
        started = time.monotonic()
        completed = [start.round]
        last_metrics: dict[str, float] = {}
        final_state: list[Any] = [parts["ctx_state"]]
        stopped = ""
        error: str | None = None
        ctx = None
        ticker = threading.Event()
        # What sending the jobs reads (a --pull-data node's training set, the
        # mesh timeout) is set before any job goes out.
        self._timeout = plan.config.mesh.timeout
        self._plan_parts = (plan, parts)
        try:
            if parts["rounds"] == 0:
                self._evaluate_only(plan, parts, out, last_metrics, final_state, pset)
            else:
                if self.collective is not None:
                    ctx = self._collective_context(plan, parts, start.round, out, completed,
                                                   last_metrics, final_state, pset)
                else:
                    group = self._connect(plan, parts)
                    train_ranks, identities = self._join(plan, group, pset)
                    pool, workers, spec = self._group_pool(plan, group, train_ranks)
                    ctx = self._context(plan, parts, pool, workers, identities, start.round,
                                        out, completed, last_metrics, final_state, pset)
                    ctx.admit = lambda: self._admit(ctx, pool, spec, pset)
                self._start_ticker(ticker, ctx, parts["rounds"], completed)
                result = parts["strategy"].run(ctx)
                final_state[0] = result.state
                last_metrics.update(result.metrics)
                stopped = result.stopped
        except KeyboardInterrupt as exc:
            how = exc.signal_name if isinstance(exc, Interrupted) else "Ctrl-C"
            error = (f"interrupted ({how}) after round {completed[0]}; workers stopped, the "
                     f"last checkpoint is intact")
            raise
        except WorkerError as exc:
            hint = self._traceback_hint(plan, exc.rank)
            located = WorkerError(exc.rank, f"{exc.detail}; {hint}")
            error = str(located)
            raise located from None
        except MeshError as exc:
            # A round that stopped on members' error replies (accept_failures) names
            # their ranks; say where each one's traceback is, as a WorkerError does.
            failed = sorted({int(r) for r in re.findall(r"rank (\d+): error: ", str(exc))})
            if failed and type(exc) in (MeshError, PeerLostError):
                hints = "; ".join(f"rank {r}: {self._traceback_hint(plan, r)}" for r in failed)
                hinted = type(exc)(f"{exc} ({hints})")
                error = str(hinted)
                raise hinted from None
            error = str(exc)
            raise
        except BaseException as exc:
            # Anything else (a bug in a task or a plugin) still failed the run:
            # summary.json and meshkit_run_finished must not report ok.
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self.finishing = True
            ticker.set()
            # Before teardown: the workers it stops leave the mesh, and that is
            # no drop.
            dropped = dict(ctx.dead) if ctx is not None else {}
            self._teardown(ctx)
            report = RunReport(
                ok=error is None, out=str(out), strategy=config.strategy.name,
                rounds=parts["rounds"] or 0, rounds_completed=completed[0],
                resumed_from=start.round if start.resumed else 0, metrics=dict(last_metrics),
                dropped=dropped,
                error=error, seconds=time.monotonic() - started, stopped=stopped,
                address=getattr(self._group, "address", "") if self._group else "",
                state=final_state[0], history=tuple(self._history))
            self.report = report
            write_summary(out, report.to_json())
            plot(out)
            self._notify(pset, "meshkit_run_finished", report=report)
        return report

    # -- steps ------------------------------------------------------------------

    def _evaluate_only(self, plan: Any, parts: dict[str, Any], out: Path,
                       last_metrics: dict[str, float], final_state: list[Any],
                       pset: Any) -> None:
        """``rounds = 0``: evaluate the model the run would start from, as round 0."""
        loaded = strategy_traits(parts["strategy"]).loaded_state
        state = loaded() if loaded is not None else None
        state = dict(state) if state is not None else parts["initial_state"]
        clock = time.perf_counter()
        metrics = dict(parts["task"].evaluate(state))
        report = RoundReport(0, 0, plan.config.strategy.name, answered=(), metrics=metrics,
                             seconds=time.perf_counter() - clock)
        append_metrics(out, report.to_json())
        last_metrics.update(metrics)
        final_state[0] = state
        self._history.append(report)
        self._emit("round", "", report)
        self._notify(pset, "meshkit_round_completed", report=report)
        if self.on_round is not None:
            self.on_round(report, state)

    def _connect(self, plan: Any, parts: dict[str, Any]) -> Any:
        cfg = plan.config
        launch = self.launch or cfg.mesh.launch
        # The preflight (build_components) refused a missing or short secret, a
        # mesh that cannot form, and authorized_nodes with a local launch already.
        secret = new_secret() if launch == "local" else cfg.secret()
        self._world = parts["world"]
        discovery = cfg.mesh.discovery or self.discovery
        mesh = cfg.mesh.topology == "mesh"
        peers = tuple(cfg.mesh.peers) or (loopback_peers(self._world) if mesh else ())
        if mesh and launch == "local":
            # A mesh forms with every rank at once: the nodes start first and
            # dial the lower ranks until they answer (within [mesh] timeout).
            self._spawn(plan, "", secret, parts["boards"], peers=peers)
        node_config = NodeConfig(
            rank=0, world=self._world, topology=cfg.mesh.topology,
            transport=cfg.mesh.transport, secret=secret, timeout=cfg.mesh.timeout,
            bind=mesh_bind(cfg.mesh.bind, peers) if mesh else cfg.mesh.bind, peers=peers,
            encrypt=cfg.mesh.encrypt, authorized_nodes=cfg.authorized_nodes(),
            discover=discovery, disc_port=cfg.mesh.discovery_port,
            trust_network=cfg.mesh.trust_network, **cfg.mesh.link_settings())
        transport = plan.create("transport")
        if mesh:
            self._emit("listening", f"coordinator forming a mesh of {self._world} ranks at "
                                    f"{', '.join(peers)}")
        group = transport.connect(node_config)
        self._group = group
        if not mesh:
            self._emit("listening", f"coordinator listening on {group.address} for "
                                    f"{cfg.mesh.workers} worker(s)")
        if discovery:
            self._emit("discovery", f"discovery responder on UDP port "
                                    f"{getattr(group, 'discovery_port', None)}")
        if launch == "local" and not mesh:
            self._spawn(plan, group.address, secret, parts["boards"])
        return group

    def _spawn(self, plan: Any, address: str, secret: bytes,
               boards: Sequence[tuple[str, Mapping[str, Any]]],
               peers: Sequence[str] = ()) -> None:
        self._tmpdir, secret_file = write_secret(secret)
        spawn_workers(self.processes, plan.config, address=address, secret_file=secret_file,
                      world=self._world, boards=boards, mesh_peers=peers)
        if self.on_workers is not None:
            self.on_workers(dict(self.processes))

    def _join(self, plan: Any, group: Any, pset: Any) -> tuple[list[int], list[Any]]:
        cfg = plan.config
        # A local worker that exits before announcing itself ends the wait at once
        # (unless min_workers lets the run start without it), quoting its last words.
        watch = ExitWatch(self.processes if not cfg.mesh.min_workers else {}, group.close)
        try:
            with watch:
                caps = collect_caps(group, timeout=cfg.mesh.join_timeout, plugins=pset,
                                    minimum=cfg.mesh.min_workers or None)
        except PeerLostError as exc:
            raise PeerLostError(watch.describe(self._out) if watch.exited else
                                f"{exc}{exited_early(self.processes, self._out)}") from None
        self._authorized = cfg.authorized_nodes()
        accepted = []
        identities = []
        train_ranks = []
        for c in caps:
            identity = self._trusted_identity(group, c)
            if identity is None:
                continue
            accepted.append(c)
            identities.append(identity)
            if self._can_place(c):
                train_ranks.append(c.rank)
                if c.pull_data:
                    self._pull.add(c.rank)
            self._emit("joined", f"rank {c.rank} joined ({c.role}, {c.platform})")
        self._caps = caps = accepted
        self._left_out = {c.rank for c in caps} - set(train_ranks)
        if not train_ranks and self._device:
            raise PlacementError(
                f"[strategy] device = {self._device!r}: no worker has it; they advertise "
                + "; ".join(f"rank {c.rank}: {', '.join(c.devices)}" for c in caps)
                + ". Start a node that has it (meshkit node --device "
                f"{self._device}), or drop the device key")
        if not train_ranks:
            raise PeerLostError("no worker that can train joined the run")
        return train_ranks, identities

    def _identity(self, c: Any) -> WorkerIdentity:
        tags = [*c.devices, c.platform, c.role]
        if c.hostname:
            tags.append(c.hostname)
        if c.fixed_function is not None:
            tags.append(c.fixed_function.stage_id)
            self._boards[c.rank] = c.fixed_function.stage_id
        return WorkerIdentity(c.rank, tuple(tags))

    def _trusted_identity(self, group: Any, c: Any) -> WorkerIdentity | None:
        """``c``'s identity with the tags its node key carries; None once it is refused.

        With ``[mesh] authorized_nodes``, a tag bound to a key is reserved
        for it: a node claiming one its key is not bound to (as a hostname,
        a device, a stage id) is told why and declared dead, and the run
        goes on with the others.
        """
        identity = self._identity(c)
        authorized = self._authorized
        if authorized is None:
            return identity
        try:
            tags = authorized.tags_for(group.peer_key(c.rank), c.rank, identity.tags)
        except AuthenticationError as exc:
            log.warning("refusing rank %d: %s", c.rank, exc)
            self._emit("refused", f"rank {c.rank} refused: {exc}")
            refuse_node(group, c.rank, str(exc))
            group.declare_dead(c.rank, f"refused: {exc}")
            self._boards.pop(c.rank, None)
            return None
        return WorkerIdentity(c.rank, tags)

    def _can_place(self, c: Any) -> bool:
        """Whether training may be placed on the rank ``c`` describes (and why not, logged)."""
        if not c.can_train():
            return False
        if self._device and not c.has_device(self._device):
            log.warning("rank %d has no %s device (it has %s): no training is placed on it",
                        c.rank, self._device, ", ".join(c.devices))
            return False
        return True

    def _admit(self, ctx: StrategyContext, pool: GroupPool, spec: Mapping[str, Any],
               pset: Any) -> list[int]:
        """Between rounds: take in the workers that joined late or restarted since.

        Each is taken back from the dead ledger (a restart), announces its
        capabilities, and is sent the run's job; it then serves the round
        about to start. One that cannot train here, or announces nothing, is
        left out (and declared dead, so a later restart may try again).
        """
        group = self._group
        assert pool.admitted is not None
        back = set(group.take_back())
        dead = group.dead
        pool.admitted -= back  # a restarted process holds nothing of the old one's
        self._left_out -= back
        fresh = sorted((set(group.joined) - pool.admitted - self._left_out - set(dead))
                       | back)
        taken: list[int] = []
        for rank in fresh:
            try:
                caps = receive_caps(group, rank, timeout=self._join_timeout, plugins=pset)
            except MeshError as exc:
                group.declare_dead(rank, f"joined but did not announce itself: {exc}")
                continue
            identity = self._trusted_identity(group, caps)
            if identity is None:
                continue
            self._caps = [c for c in self._caps if c.rank != rank] + [caps]
            ctx.identities[:] = [i for i in ctx.identities if i.rank != rank] + [identity]
            if not self._can_place(caps):
                self._left_out.add(rank)
                continue
            if caps.pull_data:
                self._pull.add(rank)
            try:
                send_job(group, rank, self._train_job(rank, spec))
            except PeerLostError as exc:
                log.warning("rank %d joined but could not be sent the job: %s", rank, exc)
                continue
            pool.admitted.add(rank)
            if rank not in ctx.workers:
                ctx.workers.append(rank)
                ctx.workers.sort()
            taken.append(rank)
            self._emit("joined", f"rank {rank} {'rejoined' if rank in back else 'joined'} "
                                 f"({caps.role}, {caps.platform}) before this round")
        return taken

    def _spec(self, plan: Any) -> dict[str, Any]:
        """The ``train`` job's spec: what every worker builds its trainer from."""
        cfg = plan.config
        spec: dict[str, Any] = {"task": cfg.run.task, "task_options": dict(cfg.task.options),
                                "strategy": cfg.strategy.name, "seed": cfg.run.seed}
        if cfg.partitioner is not None:
            spec["partitioner"] = {"name": cfg.partitioner.name,
                                   "options": dict(cfg.partitioner.options)}
        if self._device:
            spec["device"] = self._device
        return spec

    def _group_pool(self, plan: Any, group: Any, train_ranks: list[int]
                    ) -> tuple[GroupPool, list[int], dict[str, Any]]:
        """Send the joined workers their job; the pool that reaches them, and the workers."""
        spec = self._spec(plan)
        for rank in train_ranks:
            send_job(group, rank, self._train_job(rank, spec))
        pool = GroupPool(group, admitted=set(train_ranks))
        # Ranks that have not joined yet ([mesh] min_workers) count as workers
        # from the start, so the client count does not change when they come.
        joined = {c.rank for c in self._caps}
        workers = sorted(set(train_ranks) | (set(range(1, self._world)) - joined))
        return pool, workers, spec

    def _collective_context(self, plan: Any, parts: dict[str, Any], start_round: int,
                            out: Path, completed: list[int], last_metrics: dict[str, float],
                            final_state: list[Any], pset: Any) -> StrategyContext:
        """Every rank plays the round (:mod:`meshkit.train._rounds.collective`): this rank's own
        trainer, in process, is its one worker; the reducer sums the ranks' partials."""
        rank = int(self.collective.rank)
        pool = LocalPool({rank: _trainer(self._spec(plan))}, direct=True)
        ctx = self._context(plan, parts, pool, [rank], [], start_round, out, completed,
                            last_metrics, final_state, pset)
        ctx.collective = self.collective
        return ctx

    def _context(self, plan: Any, parts: dict[str, Any], pool: Any, workers: list[int],
                 identities: list[Any], start_round: int, out: Path, completed: list[int],
                 last_metrics: dict[str, float], final_state: list[Any],
                 pset: Any) -> StrategyContext:
        cfg = plan.config
        outer, rng = parts["outer"], parts["rng"]
        privacy = parts["privacy"]
        run_identity = identity(plan)
        client_local = ClientLocal(spill_dir=out)
        if parts.get("client_local"):
            client_local.load_state_dict(parts["client_local"])  # a resumed run's

        def on_round(report: Any, state: Mapping[str, Any]) -> None:
            # Checkpoint first: a metrics line never describes a round the
            # checkpoint cannot reproduce.
            line = report.to_json()
            clients_mode = cfg.run.client_metrics
            if clients_mode != "inline":
                # Per-client figures go to clients.jsonl (or nowhere), not into
                # the row, the checkpoint or the run's history: nothing grows
                # with the clients a run has served.
                line, per_client = split_clients(line)
                report = attrs.evolve(report, served={}, client_examples={},
                                      client_metrics={})
            save_checkpoint(out, Checkpoint(
                round=report.round, state=state, outer_state=outer.state_dict(),
                rng_state=rng.bit_generator.state, identity=run_identity, report=line,
                clients=client_local.state_dict(),
                aggregator_state=aggregator_state(parts["aggregator"]),
                privacy_state={} if privacy is None else privacy.state_dict(),
                strategy_state=ctx.strategy_state(), stalled_clients=ctx.stalled_clients))
            append_metrics(out, line)
            if clients_mode == "file":
                append_clients(out, per_client)
            completed[0] = report.round
            self._round_started = time.monotonic()
            last_metrics.clear()
            last_metrics.update(report.metrics)
            final_state[0] = state
            self._history.append(report)
            if _shows(report, cfg.run.progress_every):
                self._emit("round", "", report)
            self._notify(pset, "meshkit_round_completed", report=report)
            if self.on_round is not None:
                self.on_round(report, state)

        ctx = StrategyContext(
            task=parts["task"], aggregator=parts["aggregator"], pool=pool,
            workers=workers, rng=rng, seed=cfg.run.seed, outer=outer,
            outer_name=cfg.outer_optimizer.name, strategy_name=cfg.strategy.name,
            identities=identities, timeout=cfg.mesh.timeout, start_round=start_round,
            global_state=parts["global_state"], on_round=on_round, stop=self.stop,
            boards=dict(self._boards), run_board=self._run_board,
            partitioner=parts["partitioner"], client_local=client_local,
            attack=parts.get("attack"), privacy=privacy, speeds=parts.get("speeds"),
            saved=dict(parts.get("strategy_state") or {}),
            secure_aggregation=parts.get("secure_aggregation"),
            compression=parts.get("compression"), stalled_clients=parts["stalled_clients"],
            piece_bytes=cfg.mesh.piece_bytes, authorized_nodes=self._authorized,
            spill=parts.get("spill"))
        return ctx

    def _train_job(self, rank: int, spec: Mapping[str, Any]) -> dict[str, Any]:
        """The ``train`` job for ``rank``: the spec, and the training set if it asked for it."""
        job: dict[str, Any] = {"kind": "train", "job": 1, "spec": spec}
        if rank in self._pull:
            # Arrays travel as the job's own entries (the spec is JSON).
            job.update(self._pulled_data())
        return job

    def _pulled_data(self) -> dict[str, Any]:
        """The training set for nodes that asked to be sent it (``meshkit node --pull-data``)."""
        plan, parts = self._plan_parts
        if is_per_node(parts["partitioner"]):
            ranks = ", ".join(str(r) for r in sorted(self._pull))
            raise ConfigError(
                f"{plan.config.path}: rank(s) {ranks} asked for their data (--pull-data), but "
                f"[partitioner] name = \"local\" trains each node on its own data; drop "
                f"--pull-data, or use a partitioner that splits the coordinator's data")
        if is_population(parts["task"]):
            return {}  # every client is made from the task's options: nothing to send
        # Every worker may serve any client (the round engine moves work to
        # whoever is live), so such a node is sent the training set, and cuts
        # its clients' shards from it by the same partitioner as every other.
        x, y = parts["task"].train_data()
        return {"data.x": np.ascontiguousarray(x), "data.y": np.ascontiguousarray(y)}

    def _start_ticker(self, done: threading.Event, ctx: StrategyContext, rounds: int,
                      completed: list[int]) -> None:
        """Report a long round alive every ``heartbeat`` seconds until ``done`` is set."""
        every = self.heartbeat
        if not every or self.progress is None:
            return
        self._round_started = time.monotonic()

        def tick() -> None:
            while not done.wait(every):
                running = time.monotonic() - self._round_started
                if running < every:
                    continue  # a round finished since the last tick: it is not long
                live = ctx.live
                self._emit("alive", f"round {completed[0] + 1}/{rounds}: still running, "
                                    f"{running:.0f} s ({len(live)} of {len(ctx.workers)} "
                                    f"worker(s) live)")

        threading.Thread(target=tick, name="meshkit-heartbeat", daemon=True).start()

    def _traceback_hint(self, plan: Any, rank: int) -> str:
        """Where a worker's traceback is: its log file for a local launch."""
        if rank in self.processes:
            return f"its traceback is in {logs_dir(plan.config.run.out) / f'worker-{rank}.log'}"
        return f"its traceback is in the log (stderr) of `meshkit node --rank {rank}`"

    def _run_board(self, rank: int, stage_id: str, x: Any) -> Any:
        """Push rows through a fixed-function rank with the node pipeline protocol."""
        rows = np.asarray(x, dtype=np.float32).reshape(len(x), -1)
        result = run_pipeline(self._group, [Stage.board(stage_id)], self._caps, list(rows),
                              ranks=[rank], timeout=self._timeout)
        return np.stack([np.asarray(y) for y in result.outputs])

    def _teardown(self, ctx: StrategyContext | None) -> None:
        group = self._group
        if group is not None:
            try:
                # A restarted node still waiting to be taken back hears the end too.
                if callable(take_back := getattr(group, "take_back", None)):
                    take_back()
                if ctx is not None:
                    ctx.pool.stop_all(ctx.live)
                shutdown_nodes(group)
            except Exception:  # best effort: the processes are reaped below anyway
                log.debug("stopping workers failed", exc_info=True)
        reap(self.processes, dropped=set(ctx.dead) if ctx is not None else set())
        if group is not None:
            group.close()
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
        if ctx is not None and ctx.spill is not None:
            ctx.spill.close()  # its pager stops; the final model's maps stay readable

    def _notify(self, pset: Any, hook: str, **kwargs: Any) -> None:
        """An event to the installed observer plugins, then to this run's ``[[observers]]``."""
        plugins.notify(pset, hook, **kwargs)
        if self._observers is not None:
            plugins.notify(self._observers, hook, **kwargs)

    def _emit(self, kind: str, message: str, report: Any = None) -> None:
        if report is None:
            log.info("%s", message)
        if self.progress is not None:
            self.progress(RunEvent(kind, message, report))


def _already_complete(config: Config, parts: dict[str, Any], start: Start) -> RunReport:
    """``--resume`` of a finished run: its results stand, nothing is started or rewritten."""
    ckpt = start.checkpoint
    line = dict(ckpt.report or {}) if ckpt is not None else {}
    metrics = {k: v for k, v in line.items()
               if k not in REPORT_FIELDS and isinstance(v, (int, float))}
    return RunReport(
        ok=True, out=str(config.run.out), strategy=config.strategy.name,
        rounds=parts["rounds"] or 0, rounds_completed=start.round, resumed_from=start.round,
        metrics=metrics, already_complete=True,
        state=dict(ckpt.state) if ckpt is not None else None)


def run(config: Any, *, resume: bool = False, overwrite: bool = False, pset: Any = None,
        progress: Callable[[RunEvent], None] | None = None, launch: str | None = None,
        **kwargs: Any) -> RunReport:
    """Run the job ``config`` (a path, a mapping or a :class:`meshkit.config.Config`).

    Returns the :class:`RunReport` (its ``state`` is the final model); a
    user's mistake raises :class:`meshkit.MeshError` before anything starts.
    Takes :class:`Runner`'s keyword arguments.
    """
    return Runner(config, resume=resume, overwrite=overwrite, pset=pset, progress=progress,
                  launch=launch, **kwargs).run()


def _shows(report: Any, every: int) -> bool:
    """Whether a round gets a progress line (``[run] progress_every``).

    Every ``every``-th round, the last, and any round that lost a worker or
    left a client unserved: a quieter progress never hides a failure.
    """
    return (report.round % every == 0 or report.round == report.rounds
            or bool(report.dropped) or bool(report.not_served))
