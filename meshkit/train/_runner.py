"""Running a training job from one config: the coordinator side of ``meshkit run``.

Order of events (:func:`run`):

1. Resolve the config (every plugin found, every options table valid) and
   build the task, strategy, aggregator and outer optimizer
   (:func:`build_components`). A missing plugin, a bad key or a refused
   strategy fails here, before any process starts or any socket opens.
2. ``meshkit_run_started(config)`` fires.
3. The coordinator (rank 0) binds ``[mesh] bind``. With ``launch = "local"``
   it spawns ``workers`` local processes with a fresh per-run secret
   (:mod:`meshkit.train._launch`); with ``"external"`` it waits for nodes
   started elsewhere with ``meshkit node`` and the configured secret.
4. Workers announce their capabilities; each one that can train is sent a
   ``train`` job (:mod:`meshkit.train._worker` documents the spec).
5. The strategy runs. After each round: an atomic checkpoint
   (:mod:`meshkit.checkpoint`), then one line appended (and flushed) to
   ``OUT/metrics.jsonl`` recording who answered, then the progress callback
   and ``meshkit_round_completed(report)``.
6. Whatever happened, workers are stopped (local ones terminated),
   ``OUT/summary.json`` is written, ``OUT/report.png`` is drawn when
   matplotlib is installed (:mod:`meshkit.train._artifacts`), and
   ``meshkit_run_finished(report)`` fires.

A failure (a worker error, too few survivors, Ctrl-C) leaves the last
checkpoint intact; ``--resume`` continues from it.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import attrs
import numpy as np

from meshkit import plugins
from meshkit.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from meshkit.config import Config, load_config, resolve
from meshkit.errors import ConfigError, MeshError, PeerLostError
from meshkit.node import collect_caps, send_job, shutdown_nodes
from meshkit.node.config import NodeConfig
from meshkit.pipeline import Stage, run_pipeline
from meshkit.task import build_task, check_task
from meshkit.train._artifacts import (
    append_metrics,
    clear_results,
    plot,
    truncate_metrics,
    write_summary,
)
from meshkit.train._launch import exited_early, new_secret, reap, spawn_workers, write_secret
from meshkit.train._partitions import WorkerIdentity
from meshkit.train._pool import GroupPool
from meshkit.train._strategy import StrategyContext

__all__ = ["RunReport", "RunEvent", "Runner", "run", "build_components"]

log = logging.getLogger(__name__)


@attrs.frozen
class RunReport:
    """How a run ended (what ``meshkit_run_finished`` receives)."""

    ok: bool
    out: str
    strategy: str
    rounds: int
    rounds_completed: int
    resumed_from: int = 0
    metrics: Mapping[str, float] = attrs.Factory(dict)
    dropped: Mapping[int, str] = attrs.Factory(dict)
    error: str | None = None
    seconds: float = 0.0
    #: Where the coordinator listened (so a user can point nodes at it).
    address: str = ""
    #: The final global state (not in the JSON form).
    state: Mapping[str, Any] | None = attrs.field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        data = attrs.asdict(self, recurse=False)
        data.pop("state")
        data["dropped"] = {str(k): v for k, v in self.dropped.items()}
        # A task may report numpy scalars (np.float32 is not JSON); this runs
        # in run()'s finally, where an error would mask the real outcome.
        data["metrics"] = {k: _number(v) for k, v in self.metrics.items()}
        return data


def _number(value: Any) -> Any:
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


@attrs.frozen
class RunEvent:
    """Something the CLI may show: ``kind`` is "listening", "joined", "round"
    or "dropped"; ``report`` is the round's :class:`RoundReport` for "round"."""

    kind: str
    message: str = ""
    report: Any = None


def _identity(plan: Any) -> dict[str, Any]:
    cfg = plan.config
    return {"task": cfg.run.task, "strategy": cfg.strategy.name, "seed": cfg.run.seed,
            "aggregator": cfg.aggregator.name, "outer_optimizer": cfg.outer_optimizer.name}


@attrs.define
class Runner:
    """One run; :func:`run` is the usual entry point.

    ``progress(event)`` receives :class:`RunEvent` records (the CLI renders
    them). ``launch`` overrides ``[mesh] launch`` (``meshkit coordinator``
    forces "external"). ``on_workers(processes)`` is called with the local
    worker ``Popen`` objects by rank once they are spawned (tests use it to
    inject faults).
    """

    config: Any
    resume: bool = False
    pset: Any = None
    progress: Callable[[RunEvent], None] | None = None
    launch: str | None = None
    on_workers: Callable[[Mapping[int, subprocess.Popen]], None] | None = None
    on_round: Callable[[Any, Mapping[str, Any]], None] | None = None
    stop: threading.Event = attrs.Factory(threading.Event)
    processes: dict[int, subprocess.Popen] = attrs.Factory(dict)
    _tmpdir: str | None = None
    _group: Any = None
    _world: int = 0
    _caps: list[Any] = attrs.Factory(list)
    _boards: dict[int, str] = attrs.Factory(dict)
    _timeout: float | None = None
    _out: str = "."

    # -- entry ----------------------------------------------------------------

    def run(self) -> RunReport:
        config = self.config if isinstance(self.config, Config) else load_config(self.config)
        pset = self.pset if self.pset is not None else plugins.default()
        plan = resolve(config, pset)
        parts = build_components(plan)
        out = Path(config.run.out)
        self._out = str(out)
        start_round, resumed = self._prepare_out(plan, out, parts)
        pset.hook.meshkit_run_started(config=config)
        started = time.monotonic()
        completed = [start_round]
        last_metrics: dict[str, float] = {}
        final_state: list[Any] = [parts["ctx_state"]]
        error: str | None = None
        ctx = None
        try:
            group = self._connect(plan, parts["boards"])
            train_ranks, identities = self._join(plan, group, pset)
            ctx = self._context(plan, parts, group, train_ranks, identities, start_round,
                                out, completed, last_metrics, final_state, pset)
            result = parts["strategy"].run(ctx)
            final_state[0] = result.state
            last_metrics.update(result.metrics)
        except KeyboardInterrupt:
            error = "interrupted (Ctrl-C); workers terminated, the last checkpoint is intact"
            raise
        except MeshError as exc:
            error = str(exc)
            raise
        except BaseException as exc:
            # Anything else (a bug in a task or a plugin) still failed the run:
            # summary.json and meshkit_run_finished must not report ok.
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self._teardown(ctx)
            report = RunReport(
                ok=error is None, out=str(out), strategy=config.strategy.name,
                rounds=parts["rounds"], rounds_completed=completed[0],
                resumed_from=start_round if resumed else 0, metrics=dict(last_metrics),
                dropped=ctx.dead if ctx is not None else {},
                error=error, seconds=time.monotonic() - started,
                address=getattr(self._group, "address", "") if self._group else "",
                state=final_state[0])
            write_summary(out, report.to_json())
            plot(out)
            pset.hook.meshkit_run_finished(report=report)
        return report

    # -- steps ------------------------------------------------------------------

    def _prepare_out(self, plan: Any, out: Path, parts: dict[str, Any]) -> tuple[int, bool]:
        out.mkdir(parents=True, exist_ok=True)
        if not self.resume:
            clear_results(out)
            return 0, False
        ckpt = load_checkpoint(out)
        expected = _identity(plan)
        differs = {k: (ckpt.identity.get(k), v) for k, v in expected.items()
                   if ckpt.identity.get(k) != v}
        if differs:
            what = "; ".join(f"{k}: checkpoint {a!r}, config {b!r}"
                             for k, (a, b) in differs.items())
            raise ConfigError(
                f"cannot resume {str(out)!r}: its checkpoint belongs to a different run "
                f"({what}). Use the same config, or run without --resume to start afresh")
        _check_model_fits(out, ckpt.state, parts["task"].init_state(plan.config.run.seed))
        parts["global_state"] = dict(ckpt.state)
        parts["ctx_state"] = dict(ckpt.state)
        if ckpt.outer_state:
            parts["outer"].load_state_dict(ckpt.outer_state)
        if ckpt.rng_state:
            parts["rng"].bit_generator.state = dict(ckpt.rng_state)
        truncate_metrics(out, ckpt.round, ckpt.report)
        log.info("resuming %s after round %d", out, ckpt.round)
        return ckpt.round, True

    def _connect(self, plan: Any, boards: Sequence[tuple[str, Mapping[str, Any]]]) -> Any:
        cfg = plan.config
        launch = self.launch or cfg.mesh.launch
        if cfg.mesh.topology != "star":
            # The trainer protocol is coordinator <-> worker only; a full mesh
            # would need every rank's address up front and buys nothing here.
            raise ConfigError(
                f"{cfg.path}: [mesh] topology: meshkit run drives its workers as a star "
                f"(each worker dials the coordinator), got {cfg.mesh.topology!r}; set "
                f"topology = \"star\"")
        if launch == "local":
            secret = new_secret()
        else:
            secret = cfg.secret()
            if secret is None:
                raise ConfigError(
                    f"{cfg.path}: [mesh] secret_file: nodes started elsewhere must share a "
                    f"secret with the coordinator; set secret_file or MESHKIT_SECRET")
        self._world = cfg.mesh.workers + len(boards) + 1
        node_config = NodeConfig(
            rank=0, world=self._world, topology="star", transport=cfg.mesh.transport,
            secret=secret, timeout=cfg.mesh.timeout, bind=cfg.mesh.bind)
        transport = plan.create("transport")
        group = transport.connect(node_config)
        self._group = group
        self._emit("listening", f"coordinator listening on {group.address} for "
                                f"{cfg.mesh.workers} worker(s)")
        if launch == "local":
            self._spawn(plan, group.address, secret, boards)
        return group

    def _spawn(self, plan: Any, address: str, secret: bytes,
               boards: Sequence[tuple[str, Mapping[str, Any]]]) -> None:
        self._tmpdir, secret_file = write_secret(secret)
        spawn_workers(self.processes, plan.config, address=address, secret_file=secret_file,
                      world=self._world, boards=boards)
        if self.on_workers is not None:
            self.on_workers(dict(self.processes))

    def _join(self, plan: Any, group: Any, pset: Any) -> tuple[list[int], list[Any]]:
        cfg = plan.config
        try:
            caps = collect_caps(group, timeout=cfg.mesh.join_timeout, plugins=pset)
        except PeerLostError as exc:
            raise PeerLostError(
                f"{exc}{exited_early(self.processes, self._out)}") from None
        self._caps = caps
        identities = []
        train_ranks = []
        for c in caps:
            tags = [*c.devices, c.platform, c.role]
            if c.hostname:
                tags.append(c.hostname)
            if c.fixed_function is not None:
                tags.append(c.fixed_function.stage_id)
                self._boards[c.rank] = c.fixed_function.stage_id
            identities.append(WorkerIdentity(c.rank, tuple(tags)))
            if c.can_train():
                train_ranks.append(c.rank)
            self._emit("joined", f"rank {c.rank} joined ({c.role}, {c.platform})")
        if not train_ranks:
            raise PeerLostError("no worker that can train joined the run")
        return train_ranks, identities

    def _context(self, plan: Any, parts: dict[str, Any], group: Any, train_ranks: list[int],
                 identities: list[Any], start_round: int, out: Path, completed: list[int],
                 last_metrics: dict[str, float], final_state: list[Any],
                 pset: Any) -> StrategyContext:
        cfg = plan.config
        self._timeout = cfg.mesh.timeout
        spec = {"task": cfg.run.task, "task_options": dict(cfg.task.options),
                "strategy": cfg.strategy.name, "seed": cfg.run.seed}
        for rank in train_ranks:
            send_job(group, rank, {"kind": "train", "job": 1, "spec": spec})
        outer = parts["outer"]
        rng = parts["rng"]
        identity = _identity(plan)

        def on_round(report: Any, state: Mapping[str, Any]) -> None:
            # Checkpoint first: a metrics line never describes a round the
            # checkpoint cannot reproduce.
            line = report.to_json()
            save_checkpoint(out, Checkpoint(
                round=report.round, state=state, outer_state=outer.state_dict(),
                rng_state=rng.bit_generator.state, identity=identity, report=line))
            append_metrics(out, line)
            completed[0] = report.round
            last_metrics.clear()
            last_metrics.update(report.metrics)
            final_state[0] = state
            self._emit("round", "", report)
            pset.hook.meshkit_round_completed(report=report)
            if self.on_round is not None:
                self.on_round(report, state)

        return StrategyContext(
            task=parts["task"], aggregator=parts["aggregator"], pool=GroupPool(group),
            workers=train_ranks, rng=rng, seed=cfg.run.seed, outer=outer,
            outer_name=cfg.outer_optimizer.name, strategy_name=cfg.strategy.name,
            identities=identities, timeout=cfg.mesh.timeout, start_round=start_round,
            global_state=parts["global_state"], on_round=on_round, stop=self.stop,
            boards=dict(self._boards), run_board=self._run_board)

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

    def _emit(self, kind: str, message: str, report: Any = None) -> None:
        if report is None:
            log.info("%s", message)
        if self.progress is not None:
            self.progress(RunEvent(kind, message, report))


def _check_model_fits(out: Path, saved: Mapping[str, Any], fresh: Mapping[str, Any]) -> None:
    """Refuse a checkpoint whose model is not the shape this config's task builds.

    The identity check cannot see ``[task]`` options: a checkpoint made with
    ``hidden = 32`` would otherwise be trained on under ``hidden = 64``,
    silently keeping the old shapes (or failing deep inside a worker).
    """
    problems = []
    for key, value in fresh.items():
        shape = getattr(value, "shape", None)
        if shape is None:
            continue
        if key not in saved:
            problems.append(f"{key}: not in the checkpoint")
        elif getattr(saved[key], "shape", None) != shape:
            problems.append(f"{key}: checkpoint shape {getattr(saved[key], 'shape', None)}, "
                            f"this config's task {shape}")
    if problems:
        raise ConfigError(
            f"cannot resume {str(out)!r}: its checkpoint's model does not fit the task this "
            f"config builds ({'; '.join(problems[:5])}). Use the same [task] options, or run "
            f"without --resume to start afresh")


def build_components(plan: Any) -> dict[str, Any]:
    """Build every component of a resolved plan and run the strategy's own checks.

    Used by ``meshkit run`` before any process starts and by ``meshkit check``,
    so both refuse the same configs.
    """
    cfg = plan.config
    strategy = plan.create("strategy")
    if not callable(getattr(strategy, "run", None)):
        raise ConfigError(f"{cfg.path}: [strategy] {cfg.strategy.name!r} built a "
                          f"{type(strategy).__name__} with no run(ctx) method")
    try:
        task = check_task(build_task(plan.components["task"], plan.options["task"],
                                     cfg.run.task), cfg.run.task)
    except ConfigError as exc:
        raise ConfigError(f"{cfg.path}: [run] task: {exc}") from exc
    check = getattr(strategy, "check", None)
    if callable(check):
        try:
            check(task=task, outer_name=cfg.outer_optimizer.name, workers=cfg.mesh.workers)
        except ConfigError as exc:
            raise ConfigError(f"{cfg.path}: {exc}") from None
    rounds = getattr(getattr(strategy, "options", None), "rounds", 0)
    extra = getattr(strategy, "extra_ranks", None)
    return {
        "boards": list(extra()) if callable(extra) else [],
        "strategy": strategy,
        "task": task,
        "aggregator": plan.create("aggregator"),
        "outer": plan.create("outer_optimizer"),
        "rng": np.random.default_rng(cfg.run.seed),
        "rounds": int(rounds or 0),
        "ctx_state": None,
        "global_state": None,
    }


def run(config: Any, *, resume: bool = False, pset: Any = None,
        progress: Callable[[RunEvent], None] | None = None, launch: str | None = None,
        **kwargs: Any) -> RunReport:
    """Run the job ``config`` (a path or a :class:`meshkit.config.Config`)."""
    return Runner(config, resume=resume, pset=pset, progress=progress, launch=launch,
                  **kwargs).run()
