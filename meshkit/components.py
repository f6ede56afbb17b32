"""The records the kernel keeps about components: what a plugin offers, who offered it,
and which plugin (or which of its hooks) could not be used.

:class:`Component` is what a component hook returns; the kernel stamps each with
its :class:`Provenance`; a :class:`PluginFailure` is kept for a plugin that
failed to load or whose hook broke its contract, so it can be listed and quoted
instead of taking the kernel down.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs

__all__ = ["KINDS", "Component", "PluginFailure", "Provenance"]

#: Component kinds, each with the hook that offers it.
KINDS: dict[str, str] = {
    "transport": "meshkit_transports",
    "aggregator": "meshkit_aggregators",
    "outer_optimizer": "meshkit_outer_optimizers",
    "board": "meshkit_boards",
    "strategy": "meshkit_strategies",
    "task": "meshkit_tasks",
    "partitioner": "meshkit_partitioners",
    "privacy": "meshkit_privacy",
    "observer": "meshkit_observers",
    "attack": "meshkit_attacks",
    "exporter": "meshkit_exporters",
    "compression": "meshkit_compression",

    "secure_aggregation": "meshkit_secure_aggregation",
}


@attrs.frozen
class Provenance:
    """Which plugin supplied a component (stamped by the kernel, not the plugin)."""

    plugin: str
    distribution: str | None = None
    version: str | None = None

    def __str__(self) -> str:
        if self.distribution:
            return f"plugin {self.plugin!r} ({self.distribution} {self.version})"
        return f"plugin {self.plugin!r}"


def _check_options(instance: Any, attribute: Any, value: Any) -> None:
    if value is not None and not attrs.has(value):
        raise TypeError(
            f"Component {instance.name!r}: options must be an attrs class "
            f"(or None for a component without options), got {value!r}"
        )


def _as_names(value: Any) -> tuple[Any, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def _names(instance: Any, attribute: Any, value: tuple[Any, ...]) -> None:
    if not all(isinstance(v, str) and v for v in value):
        raise TypeError(f"Component {instance.name!r}: also_known_as must be a sequence of "
                        f"names (strings), got {value!r}")


@attrs.frozen
class Component:
    """One selectable component offered by a plugin.

    ``factory(options)`` builds it, where ``options`` is an instance of the
    attrs class ``options`` built from the user's config table;
    ``factory()`` when ``options`` is None.
    """

    name: str = attrs.field(validator=attrs.validators.instance_of(str))
    factory: Callable[..., Any] = attrs.field(validator=attrs.validators.is_callable())
    options: type | None = attrs.field(default=None, validator=_check_options)
    summary: str = ""
    provenance: Provenance | None = attrs.field(default=None, kw_only=True, eq=False)
    #: Names other frameworks give this component (Flower's ``FedMedian`` for
    #: ``median``), compared without case. Never selectable by them: a config
    #: naming one is told the real name and table (``Registry.get``), so a
    #: user's familiar word points the right way instead of at a near spelling.
    also_known_as: tuple[str, ...] = attrs.field(default=(), kw_only=True,
                                                 converter=_as_names, validator=_names)

    def build(self, options: Any = None) -> Any:
        """Call the factory the way the contract says (with options or without)."""
        if self.options is None:
            return self.factory()
        if options is None:
            options = self.options()
        return self.factory(options)


@attrs.frozen
class PluginFailure:
    """A plugin that could not be used, and why (shown by ``meshkit plugins``).

    ``hook`` is None when the plugin failed to load at all; otherwise it names
    the one hook that broke its contract, and the plugin's other hooks still
    work.
    """

    name: str
    distribution: str | None
    version: str | None
    error: str
    hook: str | None = attrs.field(default=None, kw_only=True)

    def describe(self) -> str:
        source = f" from {self.distribution} {self.version}" if self.distribution else ""
        if self.hook is None:
            return f"plugin {self.name!r}{source} failed to load: {self.error}"
        return f"plugin {self.name!r}{source}: {self.error}"
