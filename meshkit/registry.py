"""Collecting component records from the hooks and resolving names to them.

The rule: one plugin's mistake costs that plugin, never the others. Each
plugin's component hook is called on its own; one that raises, returns
something other than :class:`meshkit.Component` records, or offers a name
twice is recorded as a :class:`PluginFailure` and contributes nothing, while
every other plugin's components stay selectable. A name two plugins offer for
the same kind is a :class:`Conflict`: neither provider's record is used (there
is no "last one wins"), the other names of both stay available, and selecting
the conflicting name is an error naming both providers.
"""

from __future__ import annotations

from collections.abc import Iterable as _Iterable
from typing import Any, Mapping, Protocol, Sequence

import attrs

from meshkit.components import KINDS, Component, PluginFailure, Provenance
from meshkit.errors import ConfigError, PluginError, UnknownComponentError
from meshkit.options import closest, structure_options

__all__ = ["Conflict", "PluginSource", "Registry"]


class PluginSource(Protocol):
    """What a registry reads from a plugin set (:class:`meshkit.plugins.PluginSet` is one)."""

    @property
    def hook(self) -> Any:
        """The pluggy hook relay whose component hooks are collected."""

    @property
    def load_failures(self) -> Sequence[PluginFailure]:
        """Plugins that failed to load, quoted when a name is not found."""

    def provenance(self, plugin_name: str) -> Provenance:
        """Where the plugin registered as ``plugin_name`` came from."""


_COUNT = {2: "two", 3: "three", 4: "four"}


@attrs.frozen
class Conflict:
    """A name several plugins offer for one kind: selectable from none of them."""

    kind: str
    name: str
    providers: tuple[Provenance, ...]

    def describe(self) -> str:
        count = _COUNT.get(len(self.providers), str(len(self.providers)))
        return (f"{count} plugins offer the {self.kind} {self.name!r}: "
                f"{' and '.join(str(p) for p in self.providers)}; neither is used: uninstall "
                f"one, or block one with MESHKIT_DISABLE_PLUGINS")


class _BrokenHook(Exception):
    """A component hook broke its contract; the message says how."""


@attrs.frozen
class _Collected:
    components: dict[str, Component]
    conflicts: dict[str, Conflict]
    failures: list[PluginFailure]


class Registry:
    """Component records by kind and name, with the plugin that supplied each."""

    def __init__(self, source: PluginSource) -> None:
        self._pset = source
        self._by_kind: dict[str, _Collected] = {}

    # -- collecting ----------------------------------------------------------------

    def _collected(self, kind: str) -> _Collected:
        if kind not in KINDS:
            near = closest(kind, KINDS)
            hint = f" (did you mean {near!r}?)" if near else ""
            raise UnknownComponentError(
                f"unknown component kind {kind!r}{hint}; kinds are: {', '.join(KINDS)}")
        if kind not in self._by_kind:
            self._by_kind[kind] = self._collect(kind)
        return self._by_kind[kind]

    def _collect(self, kind: str) -> _Collected:
        hook_name = KINDS[kind]
        caller = getattr(self._pset.hook, hook_name)
        offers: dict[str, list[Component]] = {}
        failures: list[PluginFailure] = []
        # Call each implementation ourselves, so every record is stamped with
        # the plugin that returned it and one broken plugin is isolated; in
        # registration order, so a conflict lists its providers as they loaded.
        for impl in caller.get_hookimpls():
            provenance = self._pset.provenance(impl.plugin_name)
            try:
                records = _records(impl.function, kind)
            except _BrokenHook as exc:
                failures.append(PluginFailure(
                    provenance.plugin, provenance.distribution, provenance.version,
                    f"hook {hook_name}() {exc}; its {kind} components are left out",
                    hook=hook_name))
                continue
            for record in records:
                offers.setdefault(record.name, []).append(
                    attrs.evolve(record, provenance=provenance))
        components = {name: found[0] for name, found in sorted(offers.items())
                      if len(found) == 1}
        conflicts = {name: Conflict(kind, name, tuple(r.provenance for r in found
                                                      if r.provenance is not None))
                     for name, found in sorted(offers.items()) if len(found) > 1}
        return _Collected(components, conflicts, failures)

    # -- what exists -------------------------------------------------------------

    def available(self, kind: str) -> Mapping[str, Component]:
        """Every selectable component of ``kind``, by name (collected once, then cached).

        Names in conflict and the components of a hook that broke its contract
        are left out; :meth:`conflicts` and :meth:`failures` say what they are.
        """
        return dict(self._collected(kind).components)

    def conflicts(self, kind: str | None = None) -> list[Conflict]:
        """Names offered by several plugins, for ``kind`` or for every kind."""
        kinds = KINDS if kind is None else [kind]
        return [c for k in kinds for c in self._collected(k).conflicts.values()]

    def failures(self, kind: str | None = None) -> list[PluginFailure]:
        """Component hooks that broke their contract, for ``kind`` or for every kind
        collected so far (a kind is collected the first time it is listed or selected)."""
        if kind is not None:
            return list(self._collected(kind).failures)
        return [f for collected in self._by_kind.values() for f in collected.failures]

    def get(self, kind: str, name: str) -> Component:
        """The record for ``name``, or an error saying what exists and what went wrong."""
        collected = self._collected(kind)
        if name in collected.components:
            return collected.components[name]
        if name in collected.conflicts:
            raise PluginError(collected.conflicts[name].describe())
        elsewhere = self._known_as(kind, name)
        if elsewhere:
            raise UnknownComponentError(f"no {kind} named {name!r}: {elsewhere}")
        choices = ", ".join(sorted(collected.components)) or "none"
        near = closest(name, [*collected.components, *collected.conflicts])
        hint = f" (did you mean {near!r}?)" if near else ""
        # Any of these may be why the name is missing: a plugin that did not
        # load at all, or whose hook for this kind broke.
        notes = [*self._pset.load_failures, *collected.failures]
        failed = "".join(f"; note: {f.describe()}" for f in notes)
        raise UnknownComponentError(
            f"no {kind} named {name!r}{hint}; available: {choices}. Another plugin may "
            f"provide it: install it, or check MESHKIT_PLUGINS / "
            f"MESHKIT_DISABLE_PLUGINS{failed}")

    def _known_as(self, kind: str, name: str) -> str:
        """What ``name`` is when a component of any kind has it as its name or as one of
        its ``also_known_as`` (another framework's word); "" when none does.

        A name that exists under another kind is a likelier slip than a
        misspelling (``fedadam`` as an aggregator is the outer optimizer), so it
        is answered before "did you mean": which kind it is, what it does, and
        the line that selects it.
        """
        wanted = name.casefold()
        # This kind's own aliases first ("fedavg" as an outer optimizer is its
        # "average"), then every other kind.
        for other in (kind, *(k for k in KINDS if k != kind)):
            for component in self._collected(other).components.values():
                alias = wanted in (a.casefold() for a in component.also_known_as)
                if not alias and (other == kind or component.name.casefold() != wanted):
                    continue
                what = (f"{name!r} is known here as the {other} {component.name!r}" if alias
                        else f"{name!r} is {_a(other)}")
                does = f" ({component.summary})" if component.summary else ""
                not_this = "" if other == kind else f", not {_a(kind)}"
                select = _SELECTED_BY.get(other, f"[{other}] name =")
                return f"{what}{does}{not_this}; select it as {select} \"{component.name}\""
        return ""

    # -- building ------------------------------------------------------------------

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


def _records(function: Any, kind: str) -> list[Component]:
    """What one implementation offers, or :class:`_BrokenHook` saying how it broke."""
    try:
        result = function()
    except Exception as exc:  # a plugin's bug must not take the other plugins down
        raise _BrokenHook(f"raised {type(exc).__name__}: {exc}") from None
    if result is None:
        return []
    if isinstance(result, (str, bytes, Mapping, Component)) or not isinstance(result,
                                                                               _Iterable):
        raise _BrokenHook(f"must return an iterable of meshkit.Component records, got "
                          f"{_shown(result)}")
    records: list[Component] = []
    try:
        for record in result:
            if not isinstance(record, Component):
                raise _BrokenHook(f"must return meshkit.Component records, got "
                                  f"{_shown(record)}")
            if any(r.name == record.name for r in records):
                raise _BrokenHook(f"offers the {kind} {record.name!r} twice")
            records.append(record)
    except _BrokenHook:
        raise
    except Exception as exc:  # a generator that raises part-way
        raise _BrokenHook(f"raised {type(exc).__name__}: {exc}") from None
    return records


#: How a config selects a component of each kind (``[KIND] name =`` for the others).
_SELECTED_BY = {"task": "[run] task =", "transport": "[mesh] transport =",
                "observer": "[[observers]] name =", "board": "meshkit node --board"}


def _a(kind: str) -> str:
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
