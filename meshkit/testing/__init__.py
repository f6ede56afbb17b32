"""meshkit's pytest plugin and conformance kit for plugin authors.

Installed with meshkit and loaded by pytest through the ``pytest11`` entry
point, so every test suite of a project that installs meshkit gets:

* :func:`make_plugin_set` and the ``meshkit_plugins`` fixture: a plugin set
  built from an explicit list of plugins, no entry points loaded;
* the ``meshkit_register`` fixture: registers plugins for one test on a fresh
  default plugin set (what :func:`meshkit.plugins.create` and the CLI use),
  restored afterwards;
* contract suites, plain test classes a plugin author subclasses and points
  at a component: :class:`AggregatorContract`,
  :class:`OuterOptimizerContract`, :class:`BoardContract`,
  :class:`TransportContract`, :class:`StrategyContract`,
  :class:`TaskContract`, :class:`PartitionerContract`,
  :class:`RobustAggregatorContract`, :class:`ObserverContract`,
  :class:`ExporterContract`, :class:`CompressionContract`::

  :class:`ExporterContract`, :class:`SecureAggregationContract`::

      from meshkit.testing import AggregatorContract

      class TestMedian(AggregatorContract):
          component = "median"
          weighted = True

This module is imported into *every* pytest run of anyone who installs
meshkit, so it stays cheap: no numpy at import time; the contract suites load
on first attribute access.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from typing import Any, Callable, Iterator

import pytest

from meshkit import plugins as _plugins
from meshkit.plugins import PluginSet, installed_entry_points

__all__ = [
    "make_plugin_set",
    "use_plugins",
    "AggregatorContract",
    "OuterOptimizerContract",
    "BoardContract",
    "TransportContract",
    "StrategyContract",
    "TaskContract",
    "PartitionerContract",
    "RobustAggregatorContract",
    "ExporterContract",
    "ObserverContract",
    "CompressionContract",

    "SecureAggregationContract",
]

# The contract suites use plain ``assert``; have pytest rewrite them so a
# failure shows the values involved. Must happen before they are imported.
pytest.register_assert_rewrite(
    "meshkit.testing.aggregator",
    "meshkit.testing.outer",
    "meshkit.testing.board",
    "meshkit.testing.transport",
    "meshkit.testing.strategy",
    "meshkit.testing.support",
    "meshkit.testing.task",
    "meshkit.testing.partitioner",
    "meshkit.testing.robust",
    "meshkit.testing.exporter",
    "meshkit.testing.observer",
    "meshkit.testing.compression",

    "meshkit.testing.secure_aggregation",
)

_LAZY = {
    "CompressionContract": "meshkit.testing.compression",
    "AggregatorContract": "meshkit.testing.aggregator",
    "OuterOptimizerContract": "meshkit.testing.outer",
    "BoardContract": "meshkit.testing.board",
    "TransportContract": "meshkit.testing.transport",
    "StrategyContract": "meshkit.testing.strategy",
    "TaskContract": "meshkit.testing.task",
    "PartitionerContract": "meshkit.testing.partitioner",
    "RobustAggregatorContract": "meshkit.testing.robust",
    "ExporterContract": "meshkit.testing.exporter",
    "ObserverContract": "meshkit.testing.observer",
    "SecureAggregationContract": "meshkit.testing.secure_aggregation",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'meshkit.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def make_plugin_set(*plugins: Any, entry_points: bool = False) -> PluginSet:
    """A fresh plugin set holding exactly ``plugins`` (modules or objects).

    No entry point is loaded unless ``entry_points`` is true, so a test sees
    only what it names. A plugin with a misspelled or malformed hook raises
    :class:`meshkit.PluginError` here, exactly as it would at start-up.
    """
    environ = None
    if entry_points:
        environ = _environ_without(plugins)
    return _plugins.build_manager(list(plugins), entry_points=entry_points, environ=environ)


def _environ_without(plugins: tuple[Any, ...]) -> dict[str, str]:
    """The environment, with entry points that load one of ``plugins`` blocked.

    A plugin under test is usually also installed (editable) under an
    entry-point name; loading it twice would make every component it offers
    clash with itself.
    """
    modules = {getattr(p, "__name__", None) for p in plugins} - {None}
    environ = dict(os.environ)
    blocked = {n.strip() for n in environ.get("MESHKIT_DISABLE_PLUGINS", "").split(",")
               if n.strip()}
    for ep in installed_entry_points():
        if ep.value.split(":")[0].strip() in modules:
            blocked.add(ep.name)
    if blocked:
        environ["MESHKIT_DISABLE_PLUGINS"] = ",".join(sorted(blocked))
    return environ


@contextlib.contextmanager
def use_plugins(*plugins: Any, entry_points: bool = True) -> Iterator[PluginSet]:
    """Install a fresh default plugin set for the duration of a ``with`` block.

    ``with use_plugins(my_plugin) as pset:`` makes :func:`meshkit.plugins.create`,
    :func:`meshkit.plugins.available`, config resolution and in-process CLI
    calls see ``my_plugin`` (plus the installed entry points unless
    ``entry_points=False``); the previous default is restored on exit.
    """
    pset = make_plugin_set(*plugins, entry_points=entry_points)
    # Saved and put back as is: reset(None) would forget a default some other
    # fixture installed instead of restoring it.
    previous = _plugins.current()
    _plugins.reset(pset)
    try:
        yield pset
    finally:
        _plugins.reset(previous)


@pytest.fixture
def meshkit_plugins() -> Callable[..., PluginSet]:
    """Factory fixture: ``meshkit_plugins(plugin, ...)`` -> a plugin set of just those.

    No entry points are loaded, so the test is independent of what else is
    installed. Use ``pset.available(kind)`` / ``pset.create(kind, name,
    options)`` on the result.
    """
    return make_plugin_set


@pytest.fixture
def meshkit_register() -> Iterator[Callable[..., PluginSet]]:
    """Factory fixture: ``meshkit_register(plugin, ..., entry_points=True)``.

    Builds a fresh plugin set from ``plugins`` (plus the installed entry
    points unless ``entry_points=False``) and installs it as meshkit's
    default for this test only, so code that calls
    :func:`meshkit.plugins.create` or resolves a config sees the plugin. The
    previous default is restored when the test ends.
    """
    with contextlib.ExitStack() as stack:

        def register(*plugins: Any, entry_points: bool = True) -> PluginSet:
            return stack.enter_context(use_plugins(*plugins, entry_points=entry_points))

        yield register
