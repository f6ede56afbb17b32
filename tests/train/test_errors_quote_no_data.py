"""Over real processes: a worker's error names the problem, never the data it choked on.

The coordinator chooses ``[task]`` options, file paths included; what comes
back when a node cannot use a file must not let it read that file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_cli, write_config

pytestmark = pytest.mark.slow

SECRET_LINE = "root:x:0:0:s3cr3t-field:/root:/bin/bash"

LOADTXT_TASK = '''
import os

import numpy as np
from meshkit_tasks.digits import DigitsTask


class Loadtxt(DigitsTask):
    """digits whose fit reads a file with numpy, as a user's task might."""

    def fit(self, state, x, y, *, seed):
        np.loadtxt(os.environ["READ_THIS"], delimiter=",")
'''


def config(tmp_path: Path, task: str, task_table: str = "") -> Path:
    """One local worker; the coordinator itself reads no data (only the worker does)."""
    return write_config(tmp_path / "c.toml", tmp_path / "out", workers=1, rounds=1, task=task,
                        extra='evaluate = "clients"\n[partitioner]\nname = "local"\n[task]\n'
                              + task_table)


@pytest.fixture
def passwd(tmp_path: Path) -> Path:
    path = tmp_path / "passwd"
    path.write_text(SECRET_LINE + "\n")
    return path


def test_digits_names_the_file_and_row_of_a_file_that_is_not_digits_not_its_contents(
        tmp_path, passwd):
    table = f'train_csv = "{passwd}"\ntest_csv = "{passwd}"\n'
    result = run_cli("run", str(config(tmp_path, "digits", table)), cwd=str(tmp_path),
                     timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "rank 1" in result.stderr  # the worker's error, sent over the wire
    assert f"train_csv = {str(passwd)!r}: row 1 has 1 columns" in result.stderr
    assert "s3cr3t" not in result.stderr and "root:x" not in result.stderr


def test_a_library_error_reaches_the_coordinator_with_its_quoted_data_removed(tmp_path, passwd):
    (tmp_path / "loadtxt_task.py").write_text(LOADTXT_TASK)
    result = run_cli("run", str(config(tmp_path, "loadtxt_task:Loadtxt")),
                     cwd=str(tmp_path), env={"READ_THIS": str(passwd)}, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "fit: ValueError: could not convert string '…' to float64" in result.stderr
    assert "s3cr3t" not in result.stderr and "root:x" not in result.stderr
    # The node's own log keeps the whole message for its owner.
    assert "s3cr3t" in (tmp_path / "out" / "logs" / "worker-1.log").read_text()
