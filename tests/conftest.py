"""Shared fixtures: running the real CLI, installing real plugin packages."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import meshkit.plugins

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
                 timeout: float = 10.0, outer: str | None = None) -> Path:
    """A meshkit run config with a local launch, for the end-to-end tests."""
    path.write_text(textwrap.dedent(f"""
        [run]
        task = "{task}"
        seed = 7
        out = "{out}"

        [mesh]
        launch = "local"
        workers = {workers}
        timeout = {timeout}

        [strategy]
        name = "{strategy}"
        rounds = {rounds}
        {extra}

        [outer_optimizer]
        name = "{outer or "average"}"
    """))
    return path
