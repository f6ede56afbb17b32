"""meshkit.run with the task given as an object, as a notebook-style script does.

A script defining its task in ``__main__`` runs for real (its own Python
process, local worker processes that import the script without running its
``if __name__ == "__main__":`` block); what cannot work says what to do.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import meshkit
from meshkit import ConfigError
from meshkit.config import parse_config
from meshkit.task import reference_of, resolve_task_component

SCRIPT = Path(__file__).resolve().parents[2] / "fixtures" / "notebook_script.py"


def _python(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          cwd=str(cwd), timeout=240)


@pytest.mark.slow
def test_a_script_defining_its_task_in_main_runs_through_meshkit_run(tmp_path):
    ran = _python(str(SCRIPT), str(tmp_path / "run"), cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    result = json.loads(ran.stdout.strip().splitlines()[-1])
    # Two rounds, each moving halfway to the rows' mean [10.5, 11.5, 12.5]:
    # the workers trained the script's MeanTask.
    assert result == {"ok": True, "w": [7.875, 8.625, 9.375]}
    assert (tmp_path / "run" / "logs" / "worker-1.log").exists()


@pytest.mark.slow
def test_a_script_that_runs_unguarded_is_told_to_guard_its_call(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(SCRIPT.read_text().replace('if __name__ == "__main__":', "if True:"))
    ran = _python(str(script), str(tmp_path / "run"), cwd=tmp_path)
    assert ran.returncode != 0
    assert (f"{script} calls meshkit.run when it is imported, and a worker imports it to find "
            f"your task: put the call under if __name__ == \"__main__\":") in ran.stderr


def test_a_notebooks_task_says_how_workers_can_import_it(tmp_path):
    # python -c: a __main__ with no file, as a notebook's kernel has.
    code = SCRIPT.read_text().replace("sys.argv[1]", repr(str(tmp_path / "run")))
    ran = _python("-c", code, cwd=tmp_path)
    assert ran.returncode != 0
    assert ("[run] task: MeanTask is defined in a notebook (or an interactive session), which "
            "worker processes cannot import; move it into a .py file beside the notebook and "
            "import it from there (from mytask import MeanTask)") in ran.stderr


def test_an_object_in_an_importable_module_becomes_its_reference():
    from meshkit_tasks import options

    assert reference_of(options.DigitsOptions) == "meshkit_tasks.options:DigitsOptions"
    component = resolve_task_component(reference_of(_module_level_task))
    assert component.factory is _module_level_task


def _module_level_task():  # pragma: no cover - never built here
    raise AssertionError


def test_an_object_that_is_no_module_level_name_is_refused_saying_what_to_do():
    with pytest.raises(ConfigError, match=r"\[run\] task: .* is not a module-level name that "
                                          r"worker processes can import; assign it"):
        parse_config({"run": {"task": lambda: None}})


def test_another_component_as_an_object_says_only_the_task_may_be_one():
    component = meshkit.Component("mine", lambda: None)
    with pytest.raises(ConfigError, match=r"\[aggregator\] name: expected a component name, got "
                                          r"Component.*only \[run\] task may be an object"):
        parse_config({"aggregator": {"name": component}})
