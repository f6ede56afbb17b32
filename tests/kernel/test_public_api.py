"""Every name DESIGN.md mentions is reachable from ``import meshkit``, cheaply."""

from __future__ import annotations

import subprocess
from pathlib import Path
import sys

import pytest

import meshkit

#: Names DESIGN.md and the docs give users and plugin authors.
DESIGN_NAMES = [
    "hookimpl", "Component", "Provenance", "FixedFunction", "NodeConfig", "NodeRole",
    "NodeCaps", "NodeControl", "NodeReport", "TrainReport", "StrategyContext", "RoundReport",
    "FitResult", "serve_node", "serve_worker", "serve_fixed_function", "serve_trainer", "run",
    "MeshError", "ConfigError", "PluginError", "UnknownComponentError", "RefusedError",
    "AggregationError", "PlacementError", "WireError", "AuthenticationError", "PeerLostError",
]


@pytest.mark.parametrize("name", DESIGN_NAMES)
def test_every_design_name_is_in_meshkit_all_and_resolves(name):
    assert name in meshkit.__all__
    assert getattr(meshkit, name) is not None


@pytest.mark.parametrize("name", sorted(meshkit.__all__))
def test_every_name_in_all_resolves(name):
    getattr(meshkit, name)


def test_an_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        meshkit.nope  # noqa: B018


def _fresh(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=60).stdout.strip()


def test_plugins_api_is_reachable_after_a_bare_import_meshkit():
    out = _fresh("import meshkit; print(sorted(meshkit.plugins.available('aggregator')))")
    assert "fedavg" in out and "allreduce" in out


def test_serve_functions_are_reachable_after_a_bare_import_meshkit():
    out = _fresh("import meshkit; print(meshkit.serve_worker.__name__, "
                 "meshkit.serve_fixed_function.__name__, meshkit.serve_trainer.__name__)")
    assert out == "serve_worker serve_fixed_function serve_trainer"


def test_importing_meshkit_loads_neither_numpy_nor_any_plugin():
    out = _fresh("import sys, meshkit; print(sorted(m for m in sys.modules "
                 "if m == 'numpy' or m.startswith('meshkit_') or m.startswith('meshkit.')))")
    assert out == "['meshkit.components', 'meshkit.errors']"


def test_plan_resolve_and_check_are_meshkit_trains_public_names():
    """Issue 33 moved them out of ``meshkit.config`` (a config is resolved by the coordinator);
    public names do not change, so they are ``meshkit.train``'s, reachable from a bare
    ``import meshkit``, and ``meshkit.train.check`` resolves a config into a ``Plan``."""
    example = Path(__file__).resolve().parents[2] / "examples" / "federated.toml"
    out = _fresh("import meshkit\n"
                 "names = ('Plan', 'resolve', 'check')\n"
                 "print(all(n in meshkit.train.__all__ for n in names))\n"
                 f"plan = meshkit.train.check({str(example)!r})\n"
                 "print(type(plan) is meshkit.train.Plan, plan.components['strategy'].name)\n"
                 "print(meshkit.train.resolve(plan.config).components['strategy'].name)")
    assert out.splitlines() == ["True", "True federated", "federated"]
