"""Running the real CLI in a subprocess, and installing real plugin packages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

#: The directory of the fixture plugin packages (``meshkit-hello``).
FIXTURES = Path(__file__).parent.parent / "fixtures"


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


def plugin_env(site: str) -> dict[str, str]:
    """The environment a subprocess sees a plugin installed into ``site`` with (and no
    plugin filter or secret of the caller's), one BLAS thread."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MESHKIT_PLUGINS", "MESHKIT_DISABLE_PLUGINS", "MESHKIT_SECRET")}
    env["PYTHONPATH"] = site + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


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


def check_in_process(*args: str) -> subprocess.CompletedProcess:
    """``meshkit check ARGS`` in this process (click's runner), as ``run_cli`` returns it.

    The command's own code without a new interpreter importing meshkit again
    (about a CPU-second each); for configs whose task is built in, since a
    user's module imported here stays imported. An exception other than the
    command's exit is raised, so a traceback never passes for a refusal. Real
    ``meshkit check`` processes are tests/cli/test_check_command.py's.
    """
    from click.testing import CliRunner

    from meshkit.cli import main

    unset = {name: None for name in ("MESHKIT_PLUGINS", "MESHKIT_DISABLE_PLUGINS",
                                     "MESHKIT_SECRET")}
    result = CliRunner().invoke(main, ["check", *args], env=unset)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(["meshkit", "check", *args], result.exit_code,
                                       result.stdout, result.stderr)
