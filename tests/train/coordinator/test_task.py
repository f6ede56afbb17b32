"""Finding a task by registered name or by "module:attribute"."""

from __future__ import annotations

import sys
import textwrap

import pytest

from meshkit.train._coordinator.plan import check
from meshkit.errors import ConfigError, UnknownComponentError
from meshkit.task import create_task, resolve_task_component
from meshkit.train import build_components


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_tasks.py").write_text(textwrap.dedent('''
        import attrs
        import numpy as np
        from meshkit.task import FitResult

        class Mean:
            @attrs.frozen
            class Options:
                scale: float = 1.0

            def __init__(self, options):
                self.options = options

            def init_state(self, seed):
                return {"w": np.zeros(1)}

            def train_data(self):
                return np.ones((4, 1)), np.ones(4)

            def fit(self, state, x, y, *, seed):
                return FitResult({"w": state["w"] + self.options.scale}, len(x))

            def evaluate(self, state):
                return {"w": float(state["w"][0])}

        class NoFit:
            def init_state(self, seed):
                return {}

            def train_data(self):
                return None, None

            def evaluate(self, state):
                return {}

        not_callable = 3
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_tasks"
    sys.modules.pop("my_tasks", None)


def test_a_task_is_found_by_module_attribute_with_its_options(user_module):
    task = create_task("my_tasks:Mean", {"scale": 2.0})
    assert task.options.scale == 2.0
    assert resolve_task_component("my_tasks:Mean").options is not None


def test_a_module_attribute_task_refuses_unknown_options(user_module):
    with pytest.raises(ConfigError, match="unknown key"):
        create_task("my_tasks:Mean", {"scael": 2.0})


def test_a_task_missing_a_method_is_refused_naming_it(user_module):
    with pytest.raises(ConfigError, match=r"missing fit\(\)"):
        create_task("my_tasks:NoFit")


def test_a_module_that_does_not_import_says_so():
    with pytest.raises(ConfigError, match="cannot import module 'no_such_mod'"):
        create_task("no_such_mod:Task")


def test_a_missing_attribute_and_a_non_callable_are_refused(user_module):
    with pytest.raises(ConfigError, match="has no attribute 'Nope'"):
        create_task("my_tasks:Nope")
    with pytest.raises(ConfigError, match="not a task factory"):
        create_task("my_tasks:not_callable")


def test_an_unknown_registered_task_names_the_installed_ones():
    with pytest.raises(UnknownComponentError, match="no task named 'mnist'.*digits"):
        create_task("mnist")


def write(tmp_path, text: str, name: str = "c.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def user_tasks(tmp_path, monkeypatch):
    (tmp_path / "r2_tasks_boom.py").write_text(textwrap.dedent("""
        class Boom:
            def __init__(self):
                raise RuntimeError("no GPU here")

        class DictOptions:
            Options = dict

        flag = False
    """))
    (tmp_path / "r2_tasks_raises.py").write_text('raise RuntimeError("import-time failure")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("task, message", [
    ("r2_tasks_boom:Boom", "building it raised RuntimeError: no GPU here"),
    ("r2_tasks_raises:Task", "importing it raised RuntimeError: import-time failure"),
    (":Task", "expected a registered task name or 'module:attribute'"),
    ("r2_tasks_boom:flag", "is a bool, not a task factory"),
    ("r2_tasks_boom:DictOptions", r"is missing init_state\(\)"),
])
def test_a_module_task_that_raises_or_is_wrong_is_a_config_error_naming_the_file(
        user_tasks, task, message):
    path = write(user_tasks, f"""
        [run]
        task = "{task}"
        out = "{user_tasks / 'out'}"
    """)
    with pytest.raises(ConfigError, match=message) as err:
        build_components(check(path))
    assert str(err.value).startswith(f"{path}: [run] task")


def test_a_worker_building_a_raising_task_gets_a_config_error(user_tasks):
    with pytest.raises(ConfigError, match="building it raised RuntimeError: no GPU here"):
        create_task("r2_tasks_boom:Boom")
