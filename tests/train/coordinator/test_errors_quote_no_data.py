"""Over real processes: a worker's error names the problem, never the data it choked on.

The coordinator chooses ``[task]`` options, file paths included; what comes
back when a node cannot use a file must not let it read that file. (Any
other exception's message crosses through ``meshkit.node.sendable``,
tests/node/test_node_reports_sendable.py.)
"""

from __future__ import annotations

import pytest

from tests.support.cli import run_cli
from tests.support.configs import write_config

pytestmark = pytest.mark.slow


def test_digits_names_the_file_and_row_of_a_file_that_is_not_digits_not_its_contents(
        tmp_path):
    passwd = tmp_path / "passwd"
    passwd.write_text("root:x:0:0:s3cr3t-field:/root:/bin/bash\n")
    # One local worker; with a local partitioner and client evaluation the
    # coordinator reads no data itself: only the worker opens the file.
    config = write_config(tmp_path / "c.toml", tmp_path / "out", workers=1, rounds=1, extra=(
        'evaluate = "clients"\n[partitioner]\nname = "local"\n'
        f'[task]\ntrain_csv = "{passwd}"\ntest_csv = "{passwd}"\n'))
    result = run_cli("run", str(config), cwd=str(tmp_path), timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "rank 1" in result.stderr  # the worker's error, sent over the wire
    assert f"train_csv = {str(passwd)!r}: row 1 has 1 columns" in result.stderr
    assert "s3cr3t" not in result.stderr and "root:x" not in result.stderr
