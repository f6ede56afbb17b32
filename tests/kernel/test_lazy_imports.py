"""Packages whose public names load on first use (those whose ``__init__`` has ``_WHERE``).

Each keeps a map of where its names live (``_WHERE``) and, for the type
checker, the same names as imports under ``TYPE_CHECKING``. These tests keep
the map, the imports and ``__all__`` in step, check every name resolves to the
object its module defines, and check in a fresh interpreter that what a
``meshkit node`` imports on its way to a round leaves the coordinator's side,
the service's own side and torch unloaded (each process a run starts paid for
them: docs/benchmarks.md, "ci2").
"""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

LAZY_PACKAGES = sorted(
    ".".join(path.parent.relative_to(ROOT).parts)
    for path in (ROOT / "meshkit").rglob("__init__.py") if "\n_WHERE" in path.read_text())


def test_the_packages_the_node_needs_lightly_are_lazy():
    assert {"meshkit.train", "meshkit.service", "meshkit.privacy", "meshkit.compression",
            "meshkit.aggregation", "meshkit.secure_aggregation",
            "meshkit.pipeline"} <= set(LAZY_PACKAGES)


def _type_checking_names(package: str) -> dict[str, str]:
    """name -> module of every import under ``if TYPE_CHECKING:`` in a package's __init__."""
    path = ROOT / Path(*package.split(".")) / "__init__.py"
    names: dict[str, str] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) \
                and node.test.id == "TYPE_CHECKING":
            for child in node.body:
                assert isinstance(child, ast.ImportFrom) and child.module, ast.dump(child)
                names.update({alias.name: child.module for alias in child.names})
    return names


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_the_map_the_typed_imports_and_all_name_the_same_things(package):
    module = importlib.import_module(package)
    typed = _type_checking_names(package)
    # ControlServer needs the "serve" extra, so the type checker is not told about it.
    lazy_untyped = {"ControlServer"} if package == "meshkit.service" else set()
    assert typed == {k: v for k, v in module._WHERE.items() if k not in lazy_untyped}
    assert sorted(module.__all__) == sorted(module._WHERE)


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_every_name_is_the_object_its_module_defines(package):
    module = importlib.import_module(package)
    for name, where in module._WHERE.items():
        if name == "ControlServer":
            continue  # needs the "serve" extra; tests/service covers it
        assert getattr(module, name) is getattr(importlib.import_module(where), name), name
    assert set(module._WHERE) <= set(dir(module))
    with pytest.raises(AttributeError, match="no_such_name"):
        getattr(module, "no_such_name")


def test_a_node_loads_the_workers_side_only():
    """A fresh interpreter importing ``meshkit node``'s command, as every spawned node does."""
    code = ("import json, sys, meshkit.cli._node; "
            "print(json.dumps(sorted(m for m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120, cwd=ROOT).stdout
    loaded = set(json.loads(out))
    # What serves a round is there ...
    assert {"meshkit.train._worker.node_job", "meshkit.train._worker.trainer",
            "meshkit.service._member"} <= loaded
    # ... and the coordinator's side, the round paths, the service's side and
    # torch (a numpy task never needs it) are not.
    unwanted = {"meshkit.train._coordinator.runner", "meshkit.train._coordinator.preflight",
                "meshkit.train._rounds.engine", "meshkit.train._rounds.secure",
                "meshkit.train._rounds.collective", "meshkit.service._service",
                "meshkit.service._client", "meshkit.service._store", "torch"}
    assert loaded & unwanted == set()
