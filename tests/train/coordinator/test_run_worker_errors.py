"""A worker's error says where its traceback is; a task's missing dependency is named as such."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests.support.cli import run_cli
pytestmark = pytest.mark.slow

FAILING_TASK = '''
from meshkit_tasks.digits import DigitsTask


class Failing(DigitsTask):
    """digits whose every fit raises, as a user's bug would."""

    def fit(self, state, x, y, *, seed):
        raise ValueError("the user's fit is broken")
'''


def config(tmp_path: Path, task: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(textwrap.dedent(f"""
        [run]
        task = "{task}"
        out = "{tmp_path / 'out'}"
        [mesh]
        workers = 1
        timeout = 10.0
        [strategy]
        rounds = 2
    """))
    return path


@pytest.mark.parametrize("accept", [True, False])
def test_a_workers_error_names_the_log_holding_its_traceback_and_the_log_records_it(tmp_path,
                                                                                   accept):
    (tmp_path / "failing.py").write_text(FAILING_TASK)
    path = config(tmp_path, "failing:Failing")
    path.write_text(path.read_text() + f"accept_failures = {str(accept).lower()}\n")
    result = run_cli("run", str(path), cwd=str(tmp_path), timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    log = tmp_path / "out" / "logs" / "worker-1.log"
    if accept:  # the one client failed on the one worker: the round has nothing to fold
        assert "0 of 1 clients served, fewer than min_clients = 1" in result.stderr
        assert "rank 1: error: fit: ValueError: the user's fit is broken" in result.stderr
    else:
        assert "rank 1: fit: ValueError: the user's fit is broken" in result.stderr
    assert f"its traceback is in {log}" in result.stderr
    text = log.read_text()
    assert "Traceback" in text and "raise ValueError(\"the user's fit is broken\")" in text
    reports = [json.loads(line)["report"] for line in text.splitlines()
               if line.startswith("{") and '"report"' in line]
    assert reports and reports[-1]["error"] == "fit: ValueError: the user's fit is broken"
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["ok"] is False and str(log) in summary["error"]


def test_a_missing_dependency_inside_a_task_module_is_named_not_blamed_on_the_path(tmp_path):
    (tmp_path / "needs_dep.py").write_text(
        "import no_such_dependency_r2xyz\n\nclass Task:\n    pass\n")
    path = config(tmp_path, "needs_dep:Task")
    for command in ("check", "run"):
        result = run_cli(command, str(path), cwd=str(tmp_path))
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert ("module 'needs_dep' imports 'no_such_dependency_r2xyz', which is not installed"
                in result.stderr)
        assert "PYTHONPATH" not in result.stderr and "current directory" not in result.stderr


def test_a_task_module_that_is_not_there_says_where_it_was_looked_for(tmp_path):
    result = run_cli("check", str(config(tmp_path, "absent_r2_module:Task")), cwd=str(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "cannot import module 'absent_r2_module'" in result.stderr
    assert f"current directory ({tmp_path})" in result.stderr
