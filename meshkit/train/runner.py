"""Running a training job from one config: the coordinator side of ``meshkit run``.

Order of events (:func:`run`):

1. Resolve the config (every plugin found, every options table valid) and
   build the task, strategy, aggregator and outer optimizer. A missing
   plugin, a bad key or a refused strategy fails here, before any process
   starts or any socket opens.
2. ``meshkit_run_started(config)`` fires.
3. The coordinator (rank 0) binds ``[mesh] bind``. With ``launch = "local"``
   it writes a fresh per-run secret (0600, in a private temporary
   directory) and spawns ``workers`` subprocesses ``python -m meshkit node
   --rank i ...`` on loopback; with ``"external"`` it waits for nodes
   started elsewhere with ``meshkit node`` and the configured secret.
4. Workers announce their capabilities; each one that can train is sent a
   ``train`` job (:mod:`meshkit.train.worker` documents the spec).
5. The strategy runs. After each round: an atomic checkpoint
   (:mod:`meshkit.checkpoint`), then one line appended (and flushed) to
   ``OUT/metrics.jsonl`` recording who answered, then the progress callback
   and ``meshkit_round_completed(report)``.
6. Whatever happened, workers are stopped (local ones terminated),
   ``OUT/report.png`` is drawn when matplotlib is installed, and
   ``meshkit_run_finished(report)`` fires.

A failure (a worker error, too few survivors, Ctrl-C) leaves the last
checkpoint intact; ``--resume`` continues from it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import attrs

from meshkit.errors import ConfigError, MeshError, PeerLostError

__all__ = ["RunReport", "Runner", "run", "METRICS_NAME", "REPORT_NAME"]

log = logging.getLogger(__name__)

METRICS_NAME = "metrics.jsonl"
REPORT_NAME = "report.png"
_SECRET_NAME = "secret"


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
        from meshkit import plugins
        from meshkit.config import Config, load_config, resolve

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
                dropped=dict(ctx.drop_reasons) if ctx is not None else {},
                error=error, seconds=time.monotonic() - started,
                address=getattr(self._group, "address", "") if self._group else "",
                state=final_state[0])
            self._write_summary(out, report)
            _plot(out)
            pset.hook.meshkit_run_finished(report=report)
        return report

    # -- steps ------------------------------------------------------------------

    def _prepare_out(self, plan: Any, out: Path, parts: dict[str, Any]) -> tuple[int, bool]:
        from meshkit.checkpoint import load_checkpoint

        out.mkdir(parents=True, exist_ok=True)
        metrics = out / METRICS_NAME
        if not self.resume:
            # A fresh run owns its directory's results: stale rounds from an
            # earlier run would be read as this one's.
            metrics.write_text("")
            for stale in ("checkpoint.npz", REPORT_NAME, "summary.json"):
                (out / stale).unlink(missing_ok=True)
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
        _truncate_metrics(metrics, ckpt.round, ckpt.report)
        log.info("resuming %s after round %d", out, ckpt.round)
        return ckpt.round, True

    def _connect(self, plan: Any, boards: Sequence[tuple[str, Mapping[str, Any]]]) -> Any:
        from meshkit.node.config import NodeConfig

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
            secret = secrets.token_hex(32).encode()
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
        cfg = plan.config
        self._tmpdir = tempfile.mkdtemp(prefix="meshkit-run-")
        secret_file = Path(self._tmpdir) / _SECRET_NAME
        fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(secret)
        logs = Path(cfg.run.out) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.pop("MESHKIT_SECRET", None)
        # Workers import a "module:attribute" task the way the coordinator did.
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in [os.getcwd(), env.get("PYTHONPATH", "")] if p)
        # Workers are ranks 1..workers; fixed-function boards follow them.
        extra: dict[int, list[str]] = {}
        for i, (board, options) in enumerate(boards):
            flags = ["--board", board]
            for key, value in options.items():
                text = ("true" if value else "false") if isinstance(value, bool) else str(value)
                flags += ["--board-option", f"{key}={text}"]
            extra[cfg.mesh.workers + 1 + i] = flags
        # Every rank uses the same [transport] options as the coordinator.
        transport_flags: list[str] = []
        for key, value in cfg.transport.options.items():
            text = ("true" if value else "false") if isinstance(value, bool) else str(value)
            transport_flags += ["--transport-option", f"{key}={text}"]
        for rank in range(1, self._world):
            cmd = [sys.executable, "-m", "meshkit", "node", "--rank", str(rank),
                   "--world", str(self._world), "--peers", address,
                   "--topology", "star", "--transport", cfg.mesh.transport,
                   "--timeout", str(cfg.mesh.timeout), "--secret-file", str(secret_file),
                   *transport_flags, *extra.get(rank, [])]
            log_file = open(logs / f"worker-{rank}.log", "wb")
            try:
                # A new session: Ctrl-C in the terminal reaches the coordinator
                # only, which then stops its workers in order.
                self.processes[rank] = subprocess.Popen(
                    cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                    env=env, start_new_session=True)
            finally:
                log_file.close()
        if self.on_workers is not None:
            self.on_workers(dict(self.processes))

    def _join(self, plan: Any, group: Any, pset: Any) -> tuple[list[int], list[Any]]:
        from meshkit.node import collect_caps
        from meshkit.train.strategy import WorkerIdentity

        cfg = plan.config
        try:
            caps = collect_caps(group, timeout=cfg.mesh.join_timeout, plugins=pset)
        except PeerLostError as exc:
            raise PeerLostError(f"{exc}{self._worker_logs_hint()}") from None
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
                 last_metrics: dict[str, float], final_state: list[Any], pset: Any) -> Any:
        from meshkit.checkpoint import Checkpoint, save_checkpoint
        from meshkit.node import send_job
        from meshkit.train.strategy import StrategyContext
        from meshkit.train.worker import GroupPool

        cfg = plan.config
        self._timeout = cfg.mesh.timeout
        spec = {"task": cfg.run.task, "task_options": dict(cfg.task.options),
                "strategy": cfg.strategy.name, "seed": cfg.run.seed}
        for rank in train_ranks:
            send_job(group, rank, {"kind": "train", "job": 1, "spec": spec})
        metrics_path = out / METRICS_NAME
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
            with open(metrics_path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(line) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
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
        import numpy as np

        from meshkit.pipeline import Stage, run_pipeline

        rows = np.asarray(x, dtype=np.float32).reshape(len(x), -1)
        result = run_pipeline(self._group, [Stage.board(stage_id)], self._caps, list(rows),
                              ranks=[rank], timeout=self._timeout)
        return np.stack([np.asarray(y) for y in result.outputs])

    def _teardown(self, ctx: Any) -> None:
        group = self._group
        if group is not None:
            try:
                if ctx is not None:
                    ctx.pool.stop_all(ctx.live)
                from meshkit.node import shutdown_nodes

                shutdown_nodes(group)
            except Exception:  # best effort: the processes are reaped below anyway
                log.debug("stopping workers failed", exc_info=True)
        self._reap(dropped=set(ctx.dropped) if ctx is not None else set())
        if group is not None:
            group.close()
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def _reap(self, grace: float = 5.0, dropped: set[int] = frozenset()) -> None:
        # A dropped worker may be wedged (that is why it was dropped): no
        # grace for it. The others were told to stop and get time to leave.
        for rank in dropped:
            proc = self.processes.get(rank)
            if proc is not None and proc.poll() is None:
                proc.kill()
        deadline = time.monotonic() + grace
        for rank, proc in sorted(self.processes.items()):
            try:
                proc.wait(timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.terminate()
        for rank, proc in sorted(self.processes.items()):
            try:
                proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5.0)

    def _worker_logs_hint(self) -> str:
        if not self.processes:
            return ""
        exited = {r: p.poll() for r, p in self.processes.items() if p.poll() is not None}
        logs = Path(self._out) / "logs"
        if exited:
            return ("; local worker(s) exited early: "
                    + ", ".join(f"rank {r} (status {s})" for r, s in sorted(exited.items()))
                    + f" — see {logs}/worker-N.log")
        return ""

    def _emit(self, kind: str, message: str, report: Any = None) -> None:
        if report is None:
            log.info("%s", message)
        if self.progress is not None:
            self.progress(RunEvent(kind, message, report))

    def _write_summary(self, out: Path, report: RunReport) -> None:
        try:
            (out / "summary.json").write_text(json.dumps(report.to_json(), indent=2) + "\n")
        except OSError:
            log.warning("could not write %s", out / "summary.json", exc_info=True)


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


def _truncate_metrics(path: Path, last_round: int,
                      last_report: Mapping[str, Any] | None = None) -> None:
    """Keep only the lines of rounds the checkpoint covers (a crash may leave one more).

    The checkpoint is written before its round's line, so a crash between
    the two leaves the line missing: ``last_report`` (the line the
    checkpoint carries) fills that gap.
    """
    kept = []
    recorded = 0
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line from a crash
            if isinstance(row, dict) and row.get("round", 0) <= last_round:
                kept.append(line)
                recorded = max(recorded, int(row.get("round", 0)))
    if last_report and recorded < last_round == last_report.get("round"):
        kept.append(json.dumps(dict(last_report)))
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


def build_components(plan: Any) -> dict[str, Any]:
    """Build every component of a resolved plan and run the strategy's own checks.

    Used by ``meshkit run`` before any process starts and by ``meshkit check``,
    so both refuse the same configs.
    """
    import numpy as np

    from meshkit.task import build_task, check_task

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


def read_metrics(out: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The rounds recorded in ``OUT/metrics.jsonl``."""
    path = Path(out) / METRICS_NAME
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def _plot(out: Path) -> Path | None:
    """Draw ``OUT/report.png`` from metrics.jsonl when matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = read_metrics(out)
    if not rows:
        return None
    from meshkit.train.strategy import REPORT_FIELDS

    keys = sorted({k for row in rows for k, v in row.items()
                   if k not in REPORT_FIELDS and isinstance(v, (int, float))})
    if not keys:
        return None
    fig, axes = plt.subplots(len(keys), 1, figsize=(6, 2.2 * len(keys)), sharex=True,
                             squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        pts = [(r["round"], r[key]) for r in rows if key in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o")
        ax.set_ylabel(key)
        ax.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel("round")
    fig.suptitle(f"{rows[-1].get('strategy', '')}: {out}")
    fig.tight_layout()
    path = out / REPORT_NAME
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run(config: Any, *, resume: bool = False, pset: Any = None,
        progress: Callable[[RunEvent], None] | None = None, launch: str | None = None,
        **kwargs: Any) -> RunReport:
    """Run the job ``config`` (a path or a :class:`meshkit.config.Config`)."""
    return Runner(config, resume=resume, pset=pset, progress=progress, launch=launch,
                  **kwargs).run()
