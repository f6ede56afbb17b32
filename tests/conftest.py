"""Fixtures every test directory shares (helpers are in ``tests/support``)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import attrs
import pytest

import meshkit.plugins
from meshkit.config import parse_config

from tests.support.cli import FIXTURES, pip_install_target


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

# -- the `torch` marker: which quick tests CI also runs with torch installed ----------------

#: A test module that names torch anywhere (the library, ``meshkit.torch``, torchdist,
#: torchrun, a device) may behave differently with torch installed.
_NAMES_TORCH = re.compile(r"torch")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "torch: set on every test whose module mentions torch (tests/conftest.py); "
                   "CI runs the quick tests that are not `torch` only in the environment "
                   "without torch, where they exercise the same code")


#: The hang guard of a real-process (``slow``) test without its own ``timeout`` mark. The
#: suite-wide 120 s (pyproject.toml) is for quick tests; a real run's own waits have their
#: own deadlines (a ``meshkit run`` subprocess up to 300 s), and under load 30 on two cores
#: the federated torch example, the LoRA runs and a hostile-rank run each progressed past
#: 120 s and were cut off there, before any deadline of their own.
SLOW_TIMEOUT = 600


# Not trylast: `-m` deselects in a later implementation of this hook, and must see the
# `torch` mark. The directories' conftests (tests/service: 900 s) run before this one.
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mentions: dict[Path, bool] = {}
    for item in items:
        path = Path(item.path)
        if path not in mentions:
            try:
                mentions[path] = bool(_NAMES_TORCH.search(path.read_text()))
            except OSError:
                mentions[path] = True
        if mentions[path]:
            item.add_marker(pytest.mark.torch)
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT))
    _real_processes_first(items)


def _real_processes_first(items: list[pytest.Item]) -> None:
    """Order the files by how many real-process (``slow``) tests each holds, most first.

    Under ``-n 2 --dist loadfile --no-loadscope-reorder`` (CI) xdist hands the
    files out in this order, so the long ones start early and the quick ones
    fill in at the end; xdist's own order (most tests first) left the files of
    a few long runs for last, one worker finishing them while the other idled.
    A file's tests keep their order; so do files with the same count.
    """
    slow: dict[Path, int] = {}
    first: dict[Path, int] = {}
    for index, item in enumerate(items):
        path = Path(item.path)
        first.setdefault(path, index)
        slow[path] = slow.get(path, 0) + (item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: (-slow[Path(item.path)], first[Path(item.path)]))


# A fixture package's own tests run only where it is installed
# (tests/train/rounds/test_third_party_scheme.py does that), never in this suite.
collect_ignore_glob = ["fixtures/*/tests/*"]
