"""Collecting component records from the hooks and resolving names to them."""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence

import attrs

from meshkit.components import KINDS, Component, PluginFailure, Provenance
from meshkit.errors import ConfigError, PluginError, UnknownComponentError
from meshkit.options import structure_options

__all__ = ["PluginSource", "Registry"]


class PluginSource(Protocol):
    """What a registry reads from a plugin set (:class:`meshkit.plugins.PluginSet` is one)."""

    @property
    def hook(self) -> Any:
        """The pluggy hook relay whose component hooks are collected."""

    @property
    def failures(self) -> Sequence[PluginFailure]:
        """Plugins that could not be used, quoted when a name is not found."""

    def provenance(self, plugin_name: str) -> Provenance:
        """Where the plugin registered as ``plugin_name`` came from."""


class Registry:
    """Component records by kind and name, with the plugin that supplied each."""

    def __init__(self, source: PluginSource) -> None:
        self._pset = source
        self._by_kind: dict[str, dict[str, Component]] = {}

    def available(self, kind: str) -> Mapping[str, Component]:
        """Every component of ``kind``, by name (collected once, then cached)."""
        if kind not in KINDS:
            raise UnknownComponentError(
                f"unknown component kind {kind!r}; kinds are: {', '.join(KINDS)}")
        if kind in self._by_kind:
            return dict(self._by_kind[kind])
        caller = getattr(self._pset.hook, KINDS[kind])
        found: dict[str, Component] = {}
        # Call each implementation ourselves so every record can be stamped
        # with the plugin that returned it.
        for impl in reversed(caller.get_hookimpls()):
            provenance = self._pset.provenance(impl.plugin_name)
            try:
                records = impl.function()
                records = list(records or [])
            except Exception as exc:
                raise PluginError(
                    f"{provenance}: hook {KINDS[kind]}() raised "
                    f"{type(exc).__name__}: {exc}") from exc
            for record in records:
                if not isinstance(record, Component):
                    raise PluginError(
                        f"{provenance}: hook {KINDS[kind]}() must return "
                        f"meshkit.Component records, got {record!r}")
                previous = found.get(record.name)
                if previous is not None:
                    raise PluginError(
                        f"two plugins offer the {kind} {record.name!r}: "
                        f"{previous.provenance} and {provenance}; uninstall one, or "
                        f"block one with MESHKIT_DISABLE_PLUGINS")
                found[record.name] = attrs.evolve(record, provenance=provenance)
        self._by_kind[kind] = dict(sorted(found.items()))
        return dict(self._by_kind[kind])

    def get(self, kind: str, name: str) -> Component:
        """The record for ``name``, or :class:`UnknownComponentError` saying what exists."""
        components = self.available(kind)
        if name in components:
            return components[name]
        choices = ", ".join(sorted(components)) or "none"
        failed = "".join(f"; note: {f.describe()}" for f in self._pset.failures)
        raise UnknownComponentError(
            f"no {kind} named {name!r}; available: {choices}. Another plugin may "
            f"provide it: install it, or check MESHKIT_PLUGINS / "
            f"MESHKIT_DISABLE_PLUGINS{failed}")

    def options(self, kind: str, name: str, options: Mapping[str, Any] | None = None,
                *, where: str | None = None) -> Any:
        """Structure a config table into the component's options class."""
        component = self.get(kind, name)
        return structure_options(component, options or {}, where=where or f"[{kind}]")

    def create(self, kind: str, name: str, options: Mapping[str, Any] | Any = None) -> Any:
        """Build component ``name`` of ``kind``; ``options`` is a mapping or an options object."""
        component = self.get(kind, name)
        if component.options is not None and isinstance(options, component.options):
            return component.build(options)
        if options is not None and not isinstance(options, Mapping):
            raise ConfigError(
                f"options for {kind} {name!r} must be a mapping of config keys, "
                f"got {type(options).__name__}")
        return component.build(self.options(kind, name, options))
