"""Run configs written for the end-to-end tests (local launch, or nodes started elsewhere)."""

from __future__ import annotations

import textwrap
from pathlib import Path


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


def write_secret_file(path: Path, secret: bytes) -> Path:
    """``secret`` in a 0600 file at ``path``, as `[mesh] secret_file` and `--secret-file` want."""
    path.write_bytes(secret + b"\n")
    path.chmod(0o600)
    return path


def external_config(tmp_path: Path, *, workers: int, rounds: int, secret: bytes,
                    mesh: str = "", extra: str = "", bind: str = "127.0.0.1:0",
                    strategy: str = "federated") -> Path:
    """``tmp_path/run.toml``: a ``strategy`` run over nodes started elsewhere, its secret in
    ``tmp_path/secret``. ``mesh``: more ``[mesh]`` lines; ``extra``: more ``[strategy]``
    lines (and any tables after them)."""
    secret_file = write_secret_file(tmp_path / "secret", secret)
    path = tmp_path / "run.toml"
    path.write_text("\n".join([
        "[run]", 'task = "digits"', "seed = 3", f'out = "{tmp_path / "out"}"', "",
        "[mesh]", 'launch = "external"', f"workers = {workers}", f'bind = "{bind}"',
        f'secret_file = "{secret_file}"', "timeout = 20", "join_timeout = 60",
        textwrap.dedent(mesh).strip(), "",
        "[strategy]", f'name = "{strategy}"', f"rounds = {rounds}",
        textwrap.dedent(extra).strip(), ""]))
    return path


#: A worker kills the coordinator (its parent, with a local launch) at its Nth fit:
#: whatever it held then is lost with it (write it to ``killer.py``, select
#: ``task = "killer:Killer"``, and set KILL_AT_FIT and KILL_MARK).
KILLER = '''
import os, signal
from meshkit_tasks.digits import DigitsTask


class Killer(DigitsTask):
    fits = 0

    def fit(self, *args, **kwargs):
        Killer.fits += 1
        if str(Killer.fits) == os.environ.get("KILL_AT_FIT"):
            try:  # the first worker there kills the coordinator, once
                os.close(os.open(os.environ["KILL_MARK"], os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                os.kill(os.getppid(), signal.SIGKILL)
        return super().fit(*args, **kwargs)
'''
