"""Helpers the test files share, imported by name (``from tests.support.cli import run_cli``).

One module per idea: :mod:`~tests.support.cli` (the real CLI, real plugin
installs), :mod:`~tests.support.configs` (run configs),
:mod:`~tests.support.nodes` (``meshkit node`` processes),
:mod:`~tests.support.channels` (authenticated socket pairs, raw frames),
:mod:`~tests.support.states` (every-dtype states), :mod:`~tests.support.inproc_mesh`
(an in-process mesh of ``serve_node`` threads). Fixtures stay in ``conftest.py``
files; no test file imports another. Free ports are ``meshkit.train.free_ports``;
a thread whose result a test collects is ``meshkit.testing.support.Call``.
"""
