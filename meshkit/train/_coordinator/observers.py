"""The observers a config selects (``[[observers]]``): built, checked, and told the run's events.

An observer component (kind ``observer``, hook ``meshkit_observers``)
builds an object implementing any of the event hooks
(``meshkit_run_started``, ``meshkit_round_completed``,
``meshkit_run_finished``) with :data:`meshkit.hookimpl`. The run's selected
observers are registered in a plugin set of their own, one plugin per
``[[observers]]`` entry, so they hear only the run that selected them (not
a later run in the same process) and go through the same isolation as an
installed observer plugin: :func:`meshkit.plugins.notify` calls each alone,
and one that raises is logged once with its name (later failures counted)
while training goes on.
"""

from __future__ import annotations

from typing import Any

from meshkit import plugins
from meshkit.errors import ConfigError, MeshError

__all__ = ["RUN_EVENTS", "build_observers"]

#: The event hooks a run's ``[[observers]]`` hear. ``meshkit_node_joined`` is
#: fired by the node layer's capability exchange, below the run, and reaches
#: installed observer plugins only.
RUN_EVENTS = ("meshkit_run_started", "meshkit_round_completed", "meshkit_run_finished")


def build_observers(plan: Any) -> plugins.PluginSet:
    """The plugin set of ``plan``'s ``[[observers]]``, each built from its validated options.

    A factory that raises, or an object that implements none of
    :data:`RUN_EVENTS` (it would hear nothing: an option that silently does nothing), is a
    :class:`ConfigError` naming the entry; nothing has started yet.
    """
    cfg = plan.config
    built: dict[str, Any] = {}
    for index, ((component, options), selection) in enumerate(
            zip(plan.observers, cfg.observers)):
        where = f"{cfg.path}: {selection.where} name = {component.name!r}"
        try:
            observer = component.build(options)
        except MeshError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        except Exception as exc:  # a factory's bug: refused before the run starts, with its reason
            raise ConfigError(f"{where}: building it raised {type(exc).__name__}: {exc}") from exc
        name = component.name if component.name not in built else f"{component.name}#{index + 1}"
        built[name] = observer
    try:
        observers = plugins.build_manager(built, entry_points=False)
    except MeshError as exc:  # a misspelt hook on an observer object
        raise ConfigError(f"{cfg.path}: [[observers]]: {exc}") from None
    for name in built:
        heard = [h for h in observers.hooks_of(name) if h in RUN_EVENTS]
        if not heard:
            raise ConfigError(
                f"{cfg.path}: [[observers]] name = {name!r}: the observer implements none of "
                f"the run's event hooks ({', '.join(RUN_EVENTS)}), so it would hear "
                f"nothing; its plugin must mark them with @meshkit.hookimpl")
    return observers
