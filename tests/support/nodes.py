"""``meshkit node`` processes a test starts itself, and a run served by them."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable


def spawn_node(rank: int, world: int, peers: str, secret: Path, *extra: str) -> subprocess.Popen:
    """A ``meshkit node`` process (stdout and stderr piped), without the user's MESHKIT_SECRET."""
    env = {k: v for k, v in os.environ.items() if k != "MESHKIT_SECRET"}
    return subprocess.Popen(
        [sys.executable, "-m", "meshkit", "node", "--rank", str(rank), "--world", str(world),
         "--peers", peers, "--secret-file", str(secret), "--timeout", "20", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[str, str]:
    """A process's (stdout, stderr) once it ends; killed first if it outlives ``timeout``."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate(timeout=10)


def run_with_nodes(config: Path, start_nodes: Callable[[str], list[subprocess.Popen]], *,
                   on_round: Callable[[Any, Any], None] | None = None,
                   timeout: float = 180) -> Any:
    """Run ``config`` in this process while the nodes ``start_nodes(address)`` starts serve it.

    ``address`` is where the coordinator listens. Every node must exit 0; an
    error of the run is raised here. Returns the run's report.
    """
    from meshkit.train import Runner

    listening: list[str] = []
    ready = threading.Event()
    outcome: dict[str, Any] = {}

    def progress(event: Any) -> None:
        if event.kind == "listening":
            listening.append(event.message.split()[3])
            ready.set()

    def drive() -> None:
        try:
            outcome["report"] = Runner(str(config), progress=progress, on_round=on_round).run()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            outcome["error"] = exc
        ready.set()

    coordinator = threading.Thread(target=drive, daemon=True)
    coordinator.start()
    assert ready.wait(60), "the coordinator never started listening"
    assert listening, outcome.get("error")
    procs = start_nodes(listening[0])
    try:
        coordinator.join(timeout)
        assert not coordinator.is_alive(), "the run did not finish"
        for proc in procs:
            _, err = finish(proc, 60)
            assert proc.returncode == 0, err
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["report"]
