"""``meshkit serve``: the long-running service that ties the store, nodes, runs and control together.

Start-up order (:meth:`Service.start`), so a crash at any point leaves a
state the next start continues from:

1. ``STATE_DIR`` (mode 0700) and its database (migrated if older); every
   node the last process knew is marked disconnected.
2. The nodes' secret and the control token (generated once, mode 0600,
   unless ``[serve]`` names files of its own).
3. The node listener and the control server bind; with port 0 a first start
   picks free ports and every later start binds the same ones again (kept in
   the database), so nodes and clients find the service where they left it.
   ``STATE_DIR/service.json`` says where.
4. Every unfinished run is queued again, in submission order; one that was
   asked to stop is marked stopped. A run with a checkpoint resumes from it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
from pathlib import Path
from typing import Any

from meshkit import plugins, wire
from meshkit.train._coordinator.plan import resolve
from meshkit.errors import ConfigError, MeshError, RefusedError
from meshkit.service._config import ServeConfig
from meshkit.service._links import NodeListener
from meshkit.service._runs import RunJob, run_dir, service_config, write_private
from meshkit.service._scheduler import Scheduler
from meshkit.service._store import UNFINISHED, RunRecord, Store
from meshkit.train import build_components

__all__ = ["Service", "MAX_CONFIG_BYTES"]

log = logging.getLogger(__name__)

#: The largest run config (or authorized_nodes file) a submit may carry.
MAX_CONFIG_BYTES = 256 * 1024


def _bind(host: str, port: int, *, kept: str | None) -> socket.socket:
    """A listening socket on ``host:port``; port 0 reuses ``kept`` (the last start's) if free."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    wanted = port or (int(kept) if kept else 0)
    try:
        sock.bind((host, wanted))
    except OSError as exc:
        if port or not wanted:
            sock.close()
            raise ConfigError(f"cannot listen on {host}:{wanted}: {exc.strerror or exc}") from None
        log.warning("port %d (the last start's) is taken; picking another", wanted)
        sock.bind((host, 0))
    sock.listen(128)
    return sock


def _secret_file(path: Path) -> Path:
    if not path.exists():
        write_private(path, secrets.token_hex(32).encode())
    return path


class Service:
    """One ``meshkit serve`` (module docstring). Thread-safe; the control API calls into it."""

    def __init__(self, config: ServeConfig, *, pset: Any = None) -> None:
        self.config = config
        self.state = config.state
        self.pset = pset if pset is not None else plugins.default()
        self.store: Store | None = None
        self.scheduler: Scheduler | None = None
        self.listener: NodeListener | None = None
        self.control_socket: socket.socket | None = None
        self.token = b""
        self._authorized: wire.AuthorizedNodes | None = None
        self._run_auth: dict[str, wire.AuthorizedNodes | None] = {}
        self._lock = threading.Lock()

    # -- life ---------------------------------------------------------------------

    def start(self) -> None:
        cfg = self.config
        try:
            self.state.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise ConfigError(f"{cfg.path}: [serve] state_dir = {cfg.state_dir!r}: cannot create "
                              f"it: {exc.strerror or exc}") from None
        store = self.store = Store(self.state / "service.db")
        store.disconnect_all()
        secret_path = Path(cfg.secret_file) if cfg.secret_file else _secret_file(
            self.state / "nodes.secret")
        secret = wire.read_secret_file(secret_path, f"{cfg.path}: [serve] secret_file")
        token_path = Path(cfg.token_file) if cfg.token_file else _secret_file(
            self.state / "control.token")
        self.token = wire.read_secret_file(token_path, f"{cfg.path}: [serve] token_file")
        if cfg.authorized_nodes:
            self._authorized = wire.load_authorized_nodes(
                cfg.authorized_nodes, f"{cfg.path}: [serve] authorized_nodes")
        host, port = cfg.host_port("bind")
        node_sock = _bind(host, port, kept=store.get_meta("bind_port"))
        store.set_meta("bind_port", str(node_sock.getsockname()[1]))
        chost, cport = cfg.host_port("control")
        self.control_socket = _bind(chost, cport, kept=store.get_meta("control_port"))
        store.set_meta("control_port", str(self.control_socket.getsockname()[1]))
        self.scheduler = Scheduler(store, start_run=self._start_run,
                                   authorized_for=self._authorized_for)
        self.listener = NodeListener(node_sock, secret=secret, store=store,
                                     scheduler=self.scheduler, authorized=lambda: self._authorized,
                                     timeout=cfg.join_timeout)
        self._write_service_json()
        for record in store.runs(UNFINISHED):
            if record.stop_requested and record.state == "queued":
                store.update_run(record.id, state="stopped")
                continue
            store.update_run(record.id, state="queued")
            store.add_event(record.id, "queued", "queued again: the service restarted")
        self.listener.start()
        for record in store.runs(("queued",)):
            self.scheduler.enqueue(record.id)

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
        if self.control_socket is not None:
            self.control_socket.close()

    @property
    def node_address(self) -> str:
        return self.listener.address if self.listener is not None else ""

    @property
    def control_address(self) -> str:
        if self.control_socket is None:
            return ""
        host, port = self.control_socket.getsockname()[:2]
        scheme = "https" if self.config.tls_cert else "http"
        return f"{scheme}://{host}:{port}"

    def _write_service_json(self) -> None:
        info = {"nodes": self.node_address, "control": self.control_address, "pid": os.getpid(),
                "token_file": str(Path(self.config.token_file) if self.config.token_file
                                  else self.state / "control.token")}
        write_private(self.state / "service.json", json.dumps(info, indent=2).encode())

    # -- runs ---------------------------------------------------------------------

    def _run_host(self) -> str:
        return self.config.run_host or self.config.host_port("bind")[0]

    def _authorized_for(self, record: RunRecord) -> wire.AuthorizedNodes | None:
        with self._lock:
            if record.id not in self._run_auth:
                self._run_auth[record.id] = None if record.authorized is None else \
                    wire.load_authorized_nodes(run_dir(self.state, record.id) / "authorized_nodes",
                                               f"{record.name}: [mesh] authorized_nodes")
            return self._run_auth[record.id]

    def _start_run(self, record: RunRecord, ranks: dict[str, int]) -> RunJob:
        assert self.store is not None and self.scheduler is not None
        return RunJob(record, store=self.store, state=self.state, run_host=self._run_host(),
                      pset=self.pset, ranks=ranks, on_listening=self.scheduler.listening,
                      on_ended=self._ended).start()

    def _ended(self, run_id: str) -> None:
        with self._lock:
            self._run_auth.pop(run_id, None)
        assert self.scheduler is not None
        self.scheduler.run_ended(run_id)

    def submit(self, name: str, text: str, authorized: str | None = None) -> RunRecord:
        """Check a run config as ``meshkit run`` would, store it, queue it."""
        assert self.store is not None and self.scheduler is not None
        if len(text.encode()) > MAX_CONFIG_BYTES or len((authorized or "").encode()) > \
                MAX_CONFIG_BYTES:
            raise RefusedError(f"{name}: a submitted config (or authorized_nodes file) is at "
                               f"most {MAX_CONFIG_BYTES} bytes")
        check_dir = self.state / "checking" / secrets.token_hex(8)
        try:
            if authorized is not None:
                write_private(check_dir / "authorized_nodes", authorized.encode())
            config = service_config(text, name=name, directory=check_dir,
                                    run_host=self._run_host(), authorized=authorized is not None,
                                    secret_file=_secret_file(check_dir / "run.secret"))
            parts = build_components(resolve(config, self.pset), launch="external")
        finally:
            for leftover in sorted(check_dir.rglob("*"), reverse=True) if check_dir.exists() \
                    else ():
                leftover.unlink()
            if check_dir.exists():
                check_dir.rmdir()
        if config.mesh.workers < 1:
            raise RefusedError(f"{name}: [mesh] workers = {config.mesh.workers}: a service run "
                               f"needs at least one node")
        record = self.store.add_run(name=name, config=text, authorized=authorized,
                                    rounds=int(parts["rounds"] or 0), workers=config.mesh.workers)
        if authorized is not None:
            write_private(run_dir(self.state, record.id) / "authorized_nodes", authorized.encode())
        self.store.add_event(record.id, "queued", f"submitted {name}")
        self.scheduler.enqueue(record.id)
        result = self.store.run(record.id)
        assert result is not None
        return result

    def stop_run(self, run_id: str) -> RunRecord:
        """``meshkit stop``: a queued run never starts; a running one ends after its round."""
        assert self.store is not None and self.scheduler is not None
        record = self.store.run(run_id)
        if record is None:
            raise ConfigError(f"no run {run_id!r} (see `meshkit ls`)")
        if record.state not in UNFINISHED:
            return record
        self.store.update_run(run_id, stop_requested=1)
        if self.scheduler.dequeue(run_id):
            self.store.update_run(run_id, state="stopped")
            self.store.add_event(run_id, "stopped", "stopped before it started")
        else:
            job = self.scheduler.active(run_id)
            self.store.update_run(run_id, state="stopping")
            self.store.add_event(run_id, "stopping", "stop requested: ending after this round")
            if job is not None:
                job.stop()
        updated = self.store.run(run_id)
        assert updated is not None
        return updated
