"""One run of the service: its directory, its config as the service runs it, its thread.

A submitted config is stored as the submitter wrote it (the database keeps
the text); what the service changes to run it is decided here, in
:func:`service_config`, and nowhere else:

* ``[run] out`` becomes ``STATE_DIR/runs/RUN/out`` (runs never share one);
* ``[mesh] launch = "external"``, ``bind = RUN_HOST:0``, and a fresh secret
  of the run's own (``STATE_DIR/runs/RUN/run.secret``, mode 0600), sent only
  to the nodes the run admits;
* ``[mesh] authorized_nodes`` is the file the submitter's named, copied at
  submit time into ``STATE_DIR/runs/RUN/authorized_nodes``.

A run whose directory holds a checkpoint starts with ``--resume`` (a
service restarted after a crash continues where the checkpoint is, bit for
bit); one without starts afresh. Events (rounds with their metrics, nodes
joining, the end) go to the database as they happen.

Memory: a run's objects form reference cycles (its strategy context and the
runner's closures over it, its transport's threads and callbacks, its plugin
managers; and whatever cycles a third-party task or plugin makes), so
dropping the last reference to the run frees nothing by itself: it waits for
CPython's full collection, which runs once the *long-lived* objects have
grown by a quarter (tens of runs in a service), and numpy buffers do not
count towards that at all. The task's data and the run's final model stayed
alive that long (about 0.5 MB a run of ``digits``; a whole model copy per
run for a large one). So when a run ends its thread lets go of the run and
collects (one full collection: about 25 ms of CPU for a service's ~50,000
objects), *before* the run is reported ended: a run that ``meshkit ls``
shows ended holds no memory.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import secrets
import threading
import time
import tomllib
from pathlib import Path
from typing import Any, Callable, Mapping

from meshkit.checkpoint import checkpoint_path
from meshkit.config import Config, parse_config
from meshkit.errors import ConfigError, MeshError, RefusedError
from meshkit.service._protocol import Assign
from meshkit.service._store import Store
from meshkit.train import Runner, RunEvent, RunStopped

__all__ = ["RunJob", "service_config", "run_dir", "plain_json", "write_private"]

log = logging.getLogger(__name__)

#: ``[mesh]`` keys the service decides for a run (a submitted value is refused).
DECIDED = ("launch", "bind", "secret_file", "peers", "discovery")


def run_dir(state: Path, run_id: str) -> Path:
    return state / "runs" / run_id


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` readable by this user only (0600), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def plain_json(value: Any) -> Any:
    """``value`` as strict JSON holds it: numpy scalars as numbers, NaN and inf as null."""
    if isinstance(value, Mapping):
        return {str(k): plain_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_json(v) for v in value]
    if isinstance(value, (bool, str)) or value is None:
        return value
    if isinstance(value, int):
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    if number.is_integer() and hasattr(value, "dtype") and value.dtype.kind in "iu":
        return int(number)
    return number if math.isfinite(number) else None


def service_config(text: str, *, name: str, directory: Path, run_host: str,
                   authorized: bool, secret_file: Path) -> Config:
    """The config the service runs for a submitted TOML ``text`` (module docstring)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{name}: not valid TOML: {exc}") from None
    mesh = data.get("mesh", {})
    if not isinstance(mesh, dict):
        raise ConfigError(f"{name}: [mesh]: expected a table")
    for key in DECIDED:
        if key in mesh and not (key == "launch" and mesh[key] in ("local", "external")):
            raise ConfigError(
                f"{name}: [mesh] {key}: the service decides it for each run (a star of the "
                f"service's nodes on a fresh secret of the run's own); drop the key")
    if mesh.get("topology", "star") != "star":
        raise RefusedError(f"{name}: [mesh] topology = {mesh['topology']!r}: a service run is a "
                           f"star of the service's nodes; use topology = \"star\" or run it with "
                           f"`meshkit run`")
    mesh = dict(mesh, launch="external", bind=f"{run_host}:0", secret_file=str(secret_file))
    if authorized:
        mesh["authorized_nodes"] = str(directory / "authorized_nodes")
    data["mesh"] = mesh
    run = data.get("run", {})
    if not isinstance(run, dict):
        raise ConfigError(f"{name}: [run]: expected a table")
    data["run"] = dict(run, out=str(directory / "out"))
    return parse_config(data, path=name)


class RunJob:
    """One run's thread: a :class:`meshkit.train.Runner` with the nodes the scheduler chose."""

    def __init__(self, record: Any, *, store: Store, state: Path, run_host: str, pset: Any,
                 ranks: Mapping[str, int],
                 on_listening: Callable[[str, dict[int, Assign]], None],
                 on_ended: Callable[[str], None]) -> None:
        self.record = record
        self._store = store
        self._dir = run_dir(state, record.id)
        self._run_host = run_host
        self._pset = pset
        self._ranks = dict(ranks)
        self._on_listening = on_listening
        self._on_ended = on_ended
        self.runner: Runner | None = None
        self._config: Config | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._main, name=f"meshkit-run-{record.id}",
                                       daemon=True)

    def start(self) -> RunJob:
        self.thread.start()
        return self

    def stop(self) -> None:
        """End the run after its current round (its checkpoint stays)."""
        self._stop.set()

    def _main(self) -> None:
        ended: tuple[str, str | None, Any, int] = (
            "failed", "the run's thread ended before the run did", None,
            self.record.rounds_completed)
        try:
            ended = self._play()
        finally:
            # The run is over: let go of it before saying so (module docstring,
            # "Memory"). A run's objects hold reference cycles, so dropping the
            # references frees nothing until the cycle collector runs.
            self.runner = None
            self._config = None
            gc.collect()
            state, error, result, completed = ended
            run_id = self.record.id
            self._store.update_run(run_id, state=state, finished=time.time(), error=error,
                                   result=result, rounds_completed=completed)
            self._store.add_event(run_id, state, error or f"{state} after {completed} round(s)",
                                  result)
            self._on_ended(run_id)

    def _play(self) -> tuple[str, str | None, Any, int]:
        """Run it: how it ended as (state, error, result, rounds completed)."""
        # Re-read: a stop may have been asked between placement and now.
        record = self.record = self._store.run(self.record.id) or self.record
        run_id = record.id
        secret_file = self._dir / "run.secret"
        state, error, result, completed = "failed", None, None, record.rounds_completed
        try:
            # A fresh secret per start: a node that served the run before a
            # restart must be sent it again by this service.
            write_private(secret_file, secrets.token_hex(32).encode())
            config = service_config(record.config, name=record.name, directory=self._dir,
                                    run_host=self._run_host,
                                    authorized=record.authorized is not None,
                                    secret_file=secret_file)
            self._config = config
            resume = checkpoint_path(self._dir / "out").exists()
            self.runner = Runner(config, resume=resume, overwrite=not resume, pset=self._pset,
                                 progress=self._progress, stop=self._stop)
            self._store.update_run(run_id, state="stopping" if record.stop_requested
                                   else "running", started=time.time())
            self._store.add_event(run_id, "started", "resumed from its checkpoint" if resume
                                  else "started", {"ranks": self._ranks, "resume": resume})
            if record.stop_requested:
                self._stop.set()
            report = self.runner.run()
            result = plain_json(report.to_json())
            completed = report.rounds_completed
            stopped = report.stopped or self._stop.is_set()
            state = "stopped" if stopped and completed < report.rounds else "finished"
        except RunStopped:
            # `meshkit stop`: the strategy ended between rounds, checkpoint intact.
            state = "stopped"
        except MeshError as exc:
            error = str(exc)
        except Exception as exc:  # a bug in a task or plugin: the run failed, the service goes on
            log.exception("run %s failed", run_id)
            error = f"{type(exc).__name__}: {exc}"
        finally:
            if self.runner is not None and self.runner.report is not None:
                result = result or plain_json(self.runner.report.to_json())
                completed = self.runner.report.rounds_completed
        return state, error, result, completed

    def _progress(self, event: RunEvent) -> None:
        run_id = self.record.id
        if event.kind == "listening" and self.runner is not None and self._config is not None:
            secret = (self._dir / "run.secret").read_text()
            mesh = self._config.mesh
            assignments = {rank: Assign(run=run_id, address=self.runner.address, rank=rank,
                                        world=len(self._ranks) + 1, secret=secret,
                                        encrypt=mesh.encrypt, timeout=mesh.timeout)
                           for rank in self._ranks.values()}
            self._store.add_event(run_id, "listening", event.message,
                                  {"address": self.runner.address})
            self._on_listening(run_id, assignments)
        elif event.kind == "round" and event.report is not None:
            # metrics.jsonl's line, with the task's metrics also under one key
            # (the line spreads them among the report's own fields).
            line = plain_json({**event.report.to_json(), "metrics": event.report.metrics})
            self._store.add_event(run_id, "round", str(event), line)
            self._store.update_run(run_id, rounds_completed=int(event.report.round))
        else:
            self._store.add_event(run_id, event.kind, event.message)
