"""Building the plugin manager: entry points loaded one by one, failures kept.

The rule: a broken plugin costs only itself. An entry point that fails to
import, or a plugin with a misspelt hook, is recorded as a
:class:`PluginFailure` and the rest still load; a component hook that breaks
its contract is isolated by the registry (:mod:`meshkit.registry`); an
observer whose event hook raises is logged and recorded by :func:`notify`,
and the run goes on.

``meshkit.plugins.available(kind)`` and ``meshkit.plugins.create(kind, name,
options)`` are the public API; they use a default manager built from the
``meshkit`` entry-point group the first time they are called. Tests and
embedders build their own with :func:`build_manager`.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import os
import threading
from typing import Any, Iterable, Mapping, Sequence

import attrs
import pluggy

from meshkit import hookspecs
from meshkit.components import KINDS, PluginFailure, Provenance
from meshkit.errors import PluginError
from meshkit.options import closest
from meshkit.registry import Conflict, Registry

__all__ = [
    "ENTRY_POINT_GROUP",
    "EVENT_HOOKS",
    "Conflict",
    "LoadedPlugin",
    "ObserverFailure",
    "PluginFailure",
    "PluginSet",
    "build_manager",
    "default",
    "reset",
    "current",
    "installed_entry_points",
    "available",
    "create",
    "notify",
]

ENTRY_POINT_GROUP = "meshkit"

#: The event hooks (for observers): every hook spec that offers no component kind.
EVENT_HOOKS: tuple[str, ...] = tuple(sorted(
    n for n in dir(hookspecs) if n.startswith("meshkit_") and n not in KINDS.values()))

log = logging.getLogger(__name__)


@attrs.frozen
class LoadedPlugin:
    """A plugin that registered: its name and where it came from."""

    name: str
    distribution: str | None = None
    version: str | None = None


@attrs.define
class ObserverFailure:
    """An observer whose event hook raised: kept once per plugin and hook, and counted;
    only a plugin's first failure is logged as a warning (:func:`notify`)."""

    plugin: str
    hook: str
    distribution: str | None
    version: str | None
    #: The first error, as ``ExceptionType: message``.
    error: str
    count: int = 1

    def describe(self) -> str:
        source = f" ({self.distribution} {self.version})" if self.distribution else ""
        times = "" if self.count == 1 else f" ({self.count} times)"
        return (f"observer plugin {self.plugin!r}{source}: {self.hook}() raised "
                f"{self.error}{times}; meshkit went on without it")


@attrs.define
class PluginSet:
    """A pluggy manager plus what was loaded, what failed, and the registry."""

    manager: pluggy.PluginManager
    loaded: list[LoadedPlugin] = attrs.Factory(list)
    #: Plugins that did not register at all (import error, misspelt hook, ...).
    load_failures: list[PluginFailure] = attrs.Factory(list)
    #: Observers whose event hooks raised, once per plugin and hook (see :func:`notify`).
    observer_failures: list[ObserverFailure] = attrs.Factory(list)
    #: One line per ``meshkit_*`` function of a plugin that lacks its
    #: ``@meshkit.hookimpl`` marker (pluggy ignores it: the plugin is deaf to it).
    unmarked_hooks: list[str] = attrs.Factory(list)
    _registry: Registry | None = None
    _lock: threading.Lock = attrs.field(factory=threading.Lock, repr=False)

    @property
    def hook(self) -> Any:
        return self.manager.hook

    @property
    def registry(self) -> Registry:
        if self._registry is None:
            self._registry = Registry(self)
        return self._registry

    @property
    def failures(self) -> list[PluginFailure]:
        """Plugins that failed to load, then component hooks that broke their contract
        (for the kinds listed or selected so far)."""
        return [*self.load_failures, *self.registry.failures()]

    def provenance(self, plugin_name: str) -> Provenance:
        """Where the plugin registered as ``plugin_name`` came from."""
        for loaded in self.loaded:
            if loaded.name == plugin_name:
                return Provenance(loaded.name, loaded.distribution, loaded.version)
        return Provenance(plugin_name)

    def available(self, kind: str) -> Mapping[str, Any]:
        return self.registry.available(kind)

    def conflicts(self, kind: str | None = None) -> list[Conflict]:
        """Names several plugins offer for one kind (none of them is selectable)."""
        return self.registry.conflicts(kind)

    def create(self, kind: str, name: str, options: Mapping[str, Any] | None = None) -> Any:
        return self.registry.create(kind, name, options)

    def hooks_of(self, name: str) -> list[str]:
        """The meshkit hooks the plugin registered as ``name`` implements."""
        plugin = self.manager.get_plugin(name)
        if plugin is None:
            return []
        return sorted(c.name for c in self.manager.get_hookcallers(plugin) or [])

    def failure(self, name: str) -> PluginFailure | None:
        return next((f for f in self.failures if f.name == name), None)

    def register(self, plugin: Any, name: str, *, distribution: str | None = None,
                 version: str | None = None, strict: bool = True) -> bool:
        """Register one plugin object; a broken one is an error (strict) or a failure."""
        try:
            self.manager.register(plugin, name=name)
            _check_hook_names(self.manager, plugin, name)
        except Exception as exc:  # pluggy validation or our own name check
            if self.manager.is_registered(plugin):
                self.manager.unregister(plugin)
            message = str(exc) if isinstance(exc, PluginError) else f"{type(exc).__name__}: {exc}"
            if strict:
                raise PluginError(f"plugin {name!r}: {message}") from None
            self.load_failures.append(PluginFailure(name, distribution, version, message))
            return False
        self.loaded.append(LoadedPlugin(name, distribution, version))
        self._registry = None
        for warning in _unmarked_hooks(self.manager, plugin, name):
            self.unmarked_hooks.append(warning)
            log.warning("%s", warning)
        return True

    def _observer_failed(self, plugin_name: str, hook_name: str,
                         exc: Exception) -> ObserverFailure:
        error = f"{type(exc).__name__}: {exc}"
        with self._lock:
            # The first failure of a plugin is the cause; what it breaks later (a
            # round hook finding no run its start hook should have made) is a
            # consequence, counted, not reported again over the cause.
            earlier = [f for f in self.observer_failures if f.plugin == plugin_name]
            for failure in earlier:
                if failure.hook == hook_name:
                    failure.count += 1
                    break
            else:
                provenance = self.provenance(plugin_name)
                failure = ObserverFailure(plugin_name, hook_name, provenance.distribution,
                                          provenance.version, error)
                self.observer_failures.append(failure)
        if not earlier:
            # The traceback once: it is what the plugin's author needs.
            log.warning("%s; its later failures are counted, not reported",
                        failure.describe(), exc_info=exc)
        else:
            log.debug("%s (again: %s)", failure.describe(), error)
        return failure


def notify(pset: PluginSet, hook_name: str, /, **kwargs: Any) -> list[ObserverFailure]:
    """Call the event hook ``hook_name`` on every observer, one at a time; never raises.

    An observer is a guest: one whose implementation raises is logged with its
    plugin's name and the traceback, once per plugin -- its first failure, the
    cause; later ones, of any of its hooks, at debug level -- recorded in
    ``pset.observer_failures``, and the next observer is still called, so a
    broken logger or dashboard never stops a run. ``KeyboardInterrupt`` (any
    ``BaseException`` that is not an ``Exception``) still propagates. Returns
    the failures of this call (empty when every observer returned).
    """
    if hook_name not in EVENT_HOOKS:
        raise ValueError(f"{hook_name!r} is not an event hook; event hooks are: "
                         f"{', '.join(EVENT_HOOKS)}")
    caller = getattr(pset.hook, hook_name)
    failed: list[ObserverFailure] = []
    # pluggy's own call order (last registered first, tryfirst/trylast kept).
    for impl in reversed(caller.get_hookimpls()):
        others = [p for p in pset.manager.get_plugins() if p is not impl.plugin]
        # A caller holding this one plugin runs its implementation exactly as
        # pluggy would (arguments it asks for, wrappers), but alone.
        alone = pset.manager.subset_hook_caller(hook_name, remove_plugins=others)
        try:
            alone(**kwargs)
        except Exception as exc:  # an observer's bug is the observer's, not the run's
            failed.append(pset._observer_failed(impl.plugin_name, hook_name, exc))
    return failed


def _check_hook_names(manager: pluggy.PluginManager, plugin: Any, name: str) -> None:
    """Refuse a hook implementation that matches no spec (a misspelled hook)."""
    known = sorted(n for n in dir(hookspecs) if n.startswith("meshkit_"))
    for caller in manager.get_hookcallers(plugin) or []:
        if caller.has_spec():
            continue
        impls = [i for i in caller.get_hookimpls() if i.plugin is plugin]
        if all(i.optionalhook for i in impls):
            continue
        near = closest(caller.name, known)
        hint = f" (did you mean {near!r}?)" if near else ""
        raise PluginError(
            f"plugin {name!r} implements unknown hook {caller.name!r}{hint}; "
            f"meshkit's hooks are: {', '.join(known)}"
        )


def _unmarked_hooks(manager: pluggy.PluginManager, plugin: Any, name: str) -> list[str]:
    """A warning for each ``meshkit_*`` function of ``plugin`` that pluggy did not register.

    pluggy registers only what carries the ``meshkit`` marker and skips the
    rest without a word, so a hook whose ``@meshkit.hookimpl`` was lost is
    never called: an observer silently deaf to its rounds, a component hook
    whose components never appear.
    """
    registered = {c.name for c in manager.get_hookcallers(plugin) or []}
    known = sorted(n for n in dir(hookspecs) if n.startswith("meshkit_"))
    found = []
    for attr in sorted(dir(plugin)):
        if not attr.startswith("meshkit_") or attr in registered:
            continue
        try:
            value = getattr(plugin, attr)
        except Exception as exc:  # a property that raises is the plugin's business, not a hook
            log.debug("plugin %r: reading %s raised", name, attr, exc_info=exc)
            continue
        if not inspect.isroutine(value):
            continue
        if attr in known:
            why = "; pluggy ignores it, so meshkit never calls it"
        else:
            near = closest(attr, known)
            why = (" and no hook has this name" + (f" (did you mean {near!r}?)" if near else "")
                   + "; rename it if it is not meant as a hook")
        found.append(f"plugin {name!r}: {attr}() is not marked with @meshkit.hookimpl{why}")
    return found


def _names_from_env(value: str | None) -> set[str] | None:
    if value is None:
        return None
    return {n.strip() for n in value.split(",") if n.strip()}


def build_manager(
    plugins: Iterable[Any] | Mapping[str, Any] | None = None,
    *,
    entry_points: bool = True,
    environ: Mapping[str, str] | None = None,
) -> PluginSet:
    """Build a fresh plugin set.

    ``plugins`` are registered first (a mapping gives their names), strictly:
    a broken one raises :class:`PluginError`. Then, unless ``entry_points``
    is false, every entry point of the ``meshkit`` group is loaded on its own,
    honouring ``MESHKIT_PLUGINS`` (allow-list; empty loads none) and
    ``MESHKIT_DISABLE_PLUGINS`` (block-list); one that fails is recorded as a
    :class:`PluginFailure` and the rest still load.
    """
    env = os.environ if environ is None else environ
    manager = pluggy.PluginManager("meshkit")
    manager.add_hookspecs(hookspecs)
    pset = PluginSet(manager)

    if isinstance(plugins, Mapping):
        items = list(plugins.items())
    else:
        items = [(_plugin_name(p), p) for p in (plugins or [])]
    for name, plugin in items:
        pset.register(plugin, name)

    if entry_points:
        allow = _names_from_env(env.get("MESHKIT_PLUGINS"))
        block = _names_from_env(env.get("MESHKIT_DISABLE_PLUGINS")) or set()
        for ep in installed_entry_points():
            if (allow is not None and ep.name not in allow) or ep.name in block:
                continue
            dist = getattr(ep, "dist", None)
            dist_name = dist.name if dist is not None else None
            dist_version = dist.version if dist is not None else None
            if manager.has_plugin(ep.name):
                pset.load_failures.append(PluginFailure(
                    ep.name, dist_name, dist_version,
                    "another plugin is already registered under this entry-point name",
                ))
                continue
            try:
                obj = ep.load()
            except Exception as exc:  # a broken plugin must not take the kernel down
                # Reported as a load failure (`meshkit plugins`); the traceback is here.
                log.debug("plugin %r failed to load", ep.name, exc_info=exc)
                pset.load_failures.append(PluginFailure(
                    ep.name, dist_name, dist_version, f"{type(exc).__name__}: {exc}"))
                continue
            pset.register(obj, ep.name, distribution=dist_name, version=dist_version,
                          strict=False)
    manager.check_pending()
    return pset


def installed_entry_points() -> Sequence[importlib.metadata.EntryPoint]:
    """The installed entry points of the ``meshkit`` group, deduplicated and sorted."""
    eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    # Deduplicate (the same distribution seen twice on sys.path) and sort for
    # stable listings.
    seen: dict[tuple[str, str], importlib.metadata.EntryPoint] = {}
    for ep in eps:
        seen.setdefault((ep.name, ep.value), ep)
    return sorted(seen.values(), key=lambda e: e.name)


def _plugin_name(plugin: Any) -> str:
    return getattr(plugin, "__name__", None) or type(plugin).__name__ + f"@{id(plugin):x}"


_default: PluginSet | None = None
_default_lock = threading.Lock()


def default() -> PluginSet:
    """The process-wide plugin set, built from entry points on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = build_manager()
        return _default


def current() -> PluginSet | None:
    """The default plugin set if one is installed or built, without building one."""
    with _default_lock:
        return _default


def reset(pset: PluginSet | None = None) -> None:
    """Forget the default plugin set (or replace it), e.g. after installing a plugin."""
    global _default
    with _default_lock:
        _default = pset


def available(kind: str) -> Mapping[str, Any]:
    """Every component of ``kind`` offered by the default plugin set, by name."""
    return default().available(kind)


def create(kind: str, name: str, options: Mapping[str, Any] | None = None) -> Any:
    """Build the component ``name`` of ``kind`` with ``options`` from a config table."""
    return default().create(kind, name, options)
