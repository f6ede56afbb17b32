"""Shared fixtures: running the real CLI, installing real plugin packages."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any, Callable

import attrs
import pytest

import meshkit.plugins
from meshkit.config import parse_config

FIXTURES = Path(__file__).parent / "fixtures"


def free_ports(n: int) -> list[int]:
    """n distinct free ports on 127.0.0.1 (bound together, then released for the test to bind)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def run_cli(*args: str, env: dict[str, str] | None = None, pythonpath: str | None = None,
            cwd: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``python -m meshkit ARGS`` in a subprocess, the way a user would."""
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("MESHKIT_PLUGINS", "MESHKIT_DISABLE_PLUGINS", "MESHKIT_SECRET")}
    if pythonpath:
        full_env["PYTHONPATH"] = pythonpath + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "meshkit", *args], capture_output=True,
                          text=True, env=full_env, cwd=cwd, timeout=timeout)


def pip_install_target(target: Path, *package_dirs: Path) -> None:
    """Install plugin packages for real (dist-info + entry points) into ``target``.

    No dependencies and no build isolation (hatchling comes from the test
    environment): the directory goes on PYTHONPATH, so nothing is left behind.
    """
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "--no-compile", "--target", str(target),
         *(str(p) for p in package_dirs)],
        check=True, capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="session")
def hello_site(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A directory holding the installed third-party fixture package meshkit-hello."""
    target = tmp_path_factory.mktemp("hello-site")
    pip_install_target(target, FIXTURES / "meshkit-hello")
    return str(target)


@pytest.fixture(autouse=True)
def _fresh_default_plugins():
    """No test sees another's default plugin set."""
    meshkit.plugins.reset()
    yield
    meshkit.plugins.reset()


def write_config(path: Path, out: Path, *, workers: int = 3, rounds: int = 4,
                 task: str = "digits", strategy: str = "federated", extra: str = "",
                 timeout: float = 10.0, outer: str | None = None, mesh: str = "") -> Path:
    """A meshkit run config with a local launch, for the end-to-end tests.

    ``mesh``: more ``[mesh]`` lines; ``extra``: more ``[strategy]`` lines (and
    any tables after them).
    """
    path.write_text(textwrap.dedent(f"""
        [run]
        task = "{task}"
        seed = 7
        out = "{out}"

        [mesh]
        launch = "local"
        workers = {workers}
        timeout = {timeout}
        {mesh}

        [strategy]
        name = "{strategy}"
        rounds = {rounds}
        {extra}

        [outer_optimizer]
        name = "{outer or "average"}"
    """))
    return path


# -- runs whose nodes the test starts itself (launch = "external") ---------------------


def write_secret_file(path: Path, secret: bytes) -> Path:
    """``secret`` in a 0600 file at ``path``, as `[mesh] secret_file` and `--secret-file` want."""
    path.write_bytes(secret + b"\n")
    path.chmod(0o600)
    return path


def external_config(tmp_path: Path, *, workers: int, rounds: int, secret: bytes,
                    mesh: str = "", extra: str = "", bind: str = "127.0.0.1:0") -> Path:
    """``tmp_path/run.toml``: a federated run over nodes started elsewhere, its secret in
    ``tmp_path/secret``. ``mesh``: more ``[mesh]`` lines; ``extra``: more ``[strategy]``
    lines (and any tables after them)."""
    secret_file = write_secret_file(tmp_path / "secret", secret)
    path = tmp_path / "run.toml"
    path.write_text("\n".join([
        "[run]", 'task = "digits"', "seed = 3", f'out = "{tmp_path / "out"}"', "",
        "[mesh]", 'launch = "external"', f"workers = {workers}", f'bind = "{bind}"',
        f'secret_file = "{secret_file}"', "timeout = 20", "join_timeout = 60",
        textwrap.dedent(mesh).strip(), "",
        "[strategy]", 'name = "federated"', f"rounds = {rounds}",
        textwrap.dedent(extra).strip(), ""]))
    return path


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


# -- what a run hands its observers (tests/observers) ------------------------------------


@attrs.frozen
class Round:
    round: int
    metrics: dict
    examples: int = 100
    seconds: float = 0.25


@attrs.frozen
class Finished:
    ok: bool
    out: str


@pytest.fixture
def run_config(tmp_path: Path):
    """A parsed config whose ``[run] out`` is ``tmp_path/run``."""
    return parse_config({
        "run": {"task": "digits", "seed": 7, "out": str(tmp_path / "run")},
        "strategy": {"name": "federated", "rounds": 3},
        "task": {"hidden": 16},
    }, path="<mapping>")


@pytest.fixture
def reports():
    """``(Round, Finished)``: the round and run report fakes, as classes."""
    return Round, Finished


@pytest.fixture
def no_mlflow_opt_in():
    """Each test starts without MLFLOW_ALLOW_FILE_STORE and leaves none behind."""
    before = os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
    yield
    os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
    if before is not None:
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = before
