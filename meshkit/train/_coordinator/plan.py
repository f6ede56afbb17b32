"""What a config resolves to: every selected component looked up, its options table validated.

:func:`resolve` is the one place a :class:`~meshkit.config.Config` meets the
plugins: each selection's component comes from the registry (or a
``"module:attribute"`` reference, for a task), its table is structured into
the component's options class, and options a component declares
:func:`~meshkit.options.default_from` another table are filled in. The
:class:`Plan` it returns is what the preflight and the runner build from;
``meshkit check`` prints :meth:`Plan.describe`. Every problem is a
:class:`ConfigError` (or :class:`UnknownComponentError`) naming the file,
the table and the key.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import attrs

from meshkit import plugins
from meshkit.components import Component
from meshkit.config import Config, Selection, load_config
from meshkit.errors import ConfigError, PluginError
from meshkit.options import defaults_from, structure_options
from meshkit.task import resolve_task_component

__all__ = ["Plan", "resolve", "check"]


@attrs.frozen
class Plan:
    """A config with every component looked up and its options validated."""

    config: Config
    components: Mapping[str, Component]
    options: Mapping[str, Any]
    #: ``[[observers]]``, in order: each entry's component and validated options.
    observers: tuple[tuple[Component, Any], ...] = ()

    def create(self, kind: str) -> Any:
        """Build the selected component of ``kind`` with its validated options."""
        return self.components[kind].build(self.options[kind])

    def describe(self, world: int | None = None) -> list[str]:
        """The resolved plan as lines a person reads (``meshkit check``).

        ``world`` is the run's real world size when the caller knows it (a
        strategy may add fixed-function ranks to the workers); by default the
        coordinator and ``[mesh] workers``.
        """
        cfg = self.config
        lines = [
            f"config: {cfg.path}",
            f"run: task={cfg.run.task} seed={cfg.run.seed} out={cfg.run.out}",
            f"mesh: transport={cfg.mesh.transport} topology={cfg.mesh.topology} "
            f"launch={cfg.mesh.launch} workers={cfg.mesh.workers} "
            f"(world {world or cfg.mesh.workers + 1}) bind={cfg.mesh.bind}"
            + ((" peers=" + (",".join(cfg.mesh.peers) or "free loopback ports at start"))
               if cfg.mesh.topology == "mesh" else ""),
        ]
        for selection in cfg.selections():
            component = self.components[selection.kind]
            source = component.provenance or "module reference"
            opts = self.options[selection.kind]
            shown = ", ".join(f"{k}={v!r}" for k, v in attrs.asdict(opts).items()) if (
                opts is not None and attrs.has(type(opts))) else "no options"
            line = f"{selection.kind}: {component.name} from {source} [{shown}]"
            if selection.kind == "attack" and cfg.attack is not None:
                line += (f" on clients {list(cfg.attack.clients)}" if cfg.attack.clients
                         else f" on fraction {cfg.attack.fraction:g} of the clients")
            lines.append(line)
        speeds = cfg.speeds()
        if speeds is not None:
            lines.append(f"simulation: virtual clock, {speeds.describe()}")
        if cfg.secure_aggregation is not None:
            shown = ", ".join(f"{k}={v!r}" for k, v in attrs.asdict(
                cfg.secure_aggregation).items() if k != "name")
            lines.append(f"secure_aggregation: {cfg.secure_aggregation.name} [{shown}]")
        for component, opts in self.observers:
            shown = ", ".join(f"{k}={v!r}" for k, v in attrs.asdict(opts).items()) if (
                opts is not None and attrs.has(type(opts))) else "no options"
            lines.append(f"observer: {component.name} from {component.provenance} [{shown}]")
        return lines


def _module_reference(selection: Selection, path: str) -> Component:
    """A task (or other component) named ``"module:attribute"`` instead of by plugin."""
    # One lookup for the coordinator and the workers (meshkit.task), so a
    # module that raises on import, a non-callable attribute or a non-attrs
    # ``Options`` is the same clear error on both.
    try:
        return resolve_task_component(selection.name)
    except ConfigError as exc:
        raise ConfigError(f"{path}: [run] {selection.kind}: {exc}") from exc


def _with_defaults_from(component: Component, selection: Selection, config: Config
                        ) -> Selection:
    """``selection`` with each option its component declares :func:`meshkit.options.default_from`
    filled from the other table's key, when the user left it out and gave that key."""
    fill = {}
    for name, (table, key) in defaults_from(component.options).items():
        if name in selection.options:
            continue
        source = getattr(config, table, None)
        value = source.options.get(key) if isinstance(source, Selection) else None
        if value is not None:
            fill[name] = value
    if not fill:
        return selection
    return attrs.evolve(selection, options={**selection.options, **fill})


def _replace_selection(config: Config, old: Selection, new: Selection) -> Config:
    """``config`` with ``new`` where ``old`` was (so the filled table is what nodes receive)."""
    changes: dict[str, Any] = {field.name: new for field in attrs.fields(Config)
                               if getattr(config, field.name) is old}
    return attrs.evolve(config, **changes) if changes else config


def resolve(config: Config, pset: Any = None, *, environ: Mapping[str, str] | None = None) -> Plan:
    """Look up every selected component and validate its options table."""
    if pset is None:
        pset = plugins.default()
    components: dict[str, Component] = {}
    options: dict[str, Any] = {}
    for selection in config.selections():
        key_where = (
            "[run] task" if selection.kind == "task" else
            "[mesh] transport" if selection.kind == "transport" else
            f"{selection.where} name")
        if selection.kind == "task" and ":" in selection.name:
            component = _module_reference(selection, config.path)
        else:
            try:
                component = pset.registry.get(selection.kind, selection.name)
            except PluginError as exc:  # an unknown name, or one two plugins offer
                raise type(exc)(f"{config.path}: {key_where}: {exc}") from None
        filled = _with_defaults_from(component, selection, config)
        if filled is not selection:
            config = _replace_selection(config, selection, filled)
            selection = filled
        try:
            opts = structure_options(component, selection.options, where=selection.where)
        except ConfigError as exc:
            raise ConfigError(f"{config.path}: {exc}") from None
        components[selection.kind] = component
        options[selection.kind] = opts
    observers = []
    for selection in config.observers:
        try:
            component = pset.registry.get("observer", selection.name)
            opts = structure_options(component, selection.options, where=selection.where)
        except (PluginError, ConfigError) as exc:
            raise type(exc)(f"{config.path}: {selection.where} name = {selection.name!r}: "
                            f"{exc}") from None
        observers.append((component, opts))
    env = os.environ if environ is None else environ
    if config.mesh.launch != "local" and not env.get("MESHKIT_SECRET") and not config.mesh.secret_file:
        raise ConfigError(
            f"{config.path}: [mesh] secret_file: required when launch = "
            f"{config.mesh.launch!r} (nodes on other machines must share a secret); "
            f"set secret_file or MESHKIT_SECRET")
    return Plan(config=config, components=components, options=options,
                observers=tuple(observers))


def check(path: str | os.PathLike[str], pset: Any = None) -> Plan:
    """Load and resolve in one step (what ``meshkit check`` does)."""
    return resolve(load_config(path), pset)
