"""A real ``meshkit serve`` and real ``meshkit node --service`` processes, for tests.

Everything synchronises on what the processes print (one JSON line per
event) or on the control API's long poll, never on sleeps; every wait has a
deadline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from meshkit import wire
from meshkit.service import ServiceClient, locate_service

#: The longest any single wait of these helpers takes before the test fails.
DEADLINE = 120.0


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in ("MESHKIT_PLUGINS", "MESHKIT_DISABLE_PLUGINS", "MESHKIT_SECRET",
                         "MESHKIT_SERVICE", "MESHKIT_SERVICE_TOKEN_FILE")}


class Proc:
    """A subprocess whose stdout lines are collected by a thread, JSON where they parse."""

    def __init__(self, args: list[str], *, cwd: Path, name: str) -> None:
        self.name = name
        self.err_path = cwd / f"{name}.err"
        self._err = open(self.err_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "meshkit", *args], cwd=cwd,
                                     stdout=subprocess.PIPE, stderr=self._err, text=True,
                                     env=_env())
        self.lines: list[Any] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                item: Any = json.loads(raw)
            except ValueError:
                item = raw.rstrip("\n")
            with self._changed:
                self.lines.append(item)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, predicate: Callable[[Any], bool], timeout: float = DEADLINE) -> Any:
        """The first line ``predicate`` accepts (AssertionError at the deadline or on exit)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if predicate(line):
                        return line
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (not self._reader.is_alive()):
                    raise AssertionError(f"{self.name}: no such line within {timeout} s; got "
                                         f"{self.lines!r}; stderr: {self.stderr()[-3000:]}")
                self._changed.wait(remaining)

    def events(self, kind: str) -> list[dict[str, Any]]:
        with self._changed:
            return [x for x in self.lines if isinstance(x, dict) and x.get("event") == kind]

    def stderr(self) -> str:
        self._err.flush()
        return self.err_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float = DEADLINE) -> int:
        return self.proc.wait(timeout=timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)
        self._reader.join(timeout=5)
        self._err.close()


class Federation:
    """A service and its nodes under ``root`` (a tmp_path); close() ends them all."""

    def __init__(self, root: Path, **serve: Any) -> None:
        self.root = root
        self.state = root / "state"
        self.serve_options = serve
        self.procs: list[Proc] = []
        self.service: Proc | None = None
        self.nodes: dict[str, Proc] = {}
        self.keys: dict[str, str] = {}

    def start_service(self) -> dict[str, Any]:
        config = self.root / "serve.toml"
        lines = [f'state_dir = "{self.state}"'] + [f"{k} = {json.dumps(v)}"
                                                   for k, v in self.serve_options.items()]
        config.write_text("[serve]\n" + "\n".join(lines) + "\n")
        self.service = Proc(["serve", str(config), "-v"], cwd=self.root,
                            name=f"service{len(self.procs)}")
        self.procs.append(self.service)
        return dict(self.service.wait_for(lambda x: isinstance(x, dict)
                                          and x.get("event") == "serving"))

    def key(self, name: str) -> str:
        """A node key pair ``name`` (made once); returns its public line."""
        if name not in self.keys:
            path = self.root / f"{name}.key"
            wire.generate_node_key(path, comment=name)
            self.keys[name] = (self.root / f"{name}.key.pub").read_text().strip()
        return self.keys[name]

    def start_node(self, name: str, *, key: bool = True) -> Proc:
        address = json.loads((self.state / "service.json").read_text())["nodes"]
        args = ["node", "--service", address, "--secret-file", str(self.state / "nodes.secret"),
                "--rejoin-timeout", "120"]
        if key:
            self.key(name)
            args += ["--key", str(self.root / f"{name}.key")]
        node = Proc(args, cwd=self.root, name=name)
        self.procs.append(node)
        self.nodes[name] = node
        node.wait_for(lambda x: isinstance(x, dict) and x.get("event") == "joined")
        return node

    def client(self) -> ServiceClient:
        return locate_service(str(self.state))

    def wait_run(self, run: str, timeout: float = DEADLINE) -> dict[str, Any]:
        """Follow ``run``'s events (the long poll) until it ends; its final record."""
        client = self.client()
        deadline = time.monotonic() + timeout
        after = 0
        while time.monotonic() < deadline:
            page = client.events(run, after=after, wait=5.0)
            for event in page["events"]:
                after = max(after, event["seq"])
            if page["finished"]:
                return client.status(run)["run"]
        raise AssertionError(f"run {run} did not end within {timeout} s: "
                             f"{client.status(run)}")

    def wait_round(self, run: str, round_: int, timeout: float = DEADLINE) -> None:
        """Until ``run`` has completed round ``round_`` (its events, long-polled)."""
        client = self.client()
        deadline = time.monotonic() + timeout
        after = 0
        while time.monotonic() < deadline:
            page = client.events(run, after=after, wait=5.0)
            for event in page["events"]:
                after = max(after, event["seq"])
                if event["kind"] == "round" and event["data"]["round"] >= round_:
                    return
            if page["finished"]:
                raise AssertionError(f"run {run} ended before round {round_}: "
                                     f"{client.status(run)}")
        raise AssertionError(f"run {run} did not reach round {round_} within {timeout} s")

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.close()


def run_toml(path: Path, *, workers: int, rounds: int, seed: int = 0,
             authorized: str | None = None) -> Path:
    """A small federated digits run (one-round-per-tick fast) written to ``path``."""
    mesh = f'workers = {workers}\n' + (f'authorized_nodes = "{authorized}"\n' if authorized
                                       else "")
    path.write_text(f"""
[run]
task = "digits"
seed = {seed}
out = "runs/{path.stem}"

[mesh]
{mesh}
[strategy]
name = "federated"
rounds = {rounds}

[aggregator]
name = "fedavg"

[task]
hidden = 8
""")
    return path
