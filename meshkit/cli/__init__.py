"""The ``meshkit`` command line. Every :class:`MeshError` is a message and exit 2."""

from __future__ import annotations

import json
from typing import Any

import click

from meshkit import __version__
from meshkit.components import KINDS
from meshkit.errors import MeshError

__all__ = ["main"]


class _MeshGroup(click.Group):
    """A click group that turns a MeshError into one paragraph and exit status 2."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except MeshError as exc:
            click.echo(f"meshkit: error: {exc}", err=True)
            ctx.exit(2)


@click.group(cls=_MeshGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="meshkit")
def main() -> None:
    """meshkit: train and serve models across a mesh of heterogeneous nodes.

    Components (transports, aggregators, outer optimizers, boards, strategies,
    tasks) come from plugins in the `meshkit` entry-point group; select them by
    name in one TOML config.
    """


def _plugin_rows(kind: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                                            list[dict[str, Any]], list[dict[str, Any]]]:
    from meshkit import plugins

    pset = plugins.default()
    rows: list[dict[str, Any]] = []
    for k in KINDS:
        if kind is not None and k != kind:
            continue
        for name, component in pset.available(k).items():
            prov = component.provenance
            rows.append({
                "kind": k,
                "name": name,
                "plugin": prov.plugin if prov else None,
                "distribution": prov.distribution if prov else None,
                "version": prov.version if prov else None,
                "summary": component.summary,
            })
    failed = [
        {"plugin": f.name, "distribution": f.distribution, "version": f.version,
         "hook": f.hook, "error": f.error}
        for f in pset.failures
    ]
    conflicts = [
        {"kind": c.kind, "name": c.name, "error": c.describe(),
         "providers": [{"plugin": p.plugin, "distribution": p.distribution,
                        "version": p.version} for p in c.providers]}
        for c in pset.conflicts(kind)
    ]
    loaded = [
        {"plugin": p.name, "distribution": p.distribution, "version": p.version,
         "hooks": pset.hooks_of(p.name)}
        for p in pset.loaded
    ]
    return rows, failed, conflicts, loaded


@main.command("plugins")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--kind", type=click.Choice(list(KINDS)), help="Only components of this kind.")
def plugins_command(as_json: bool, kind: str | None) -> None:
    """List every discovered component, and plugins that failed to load.

    Plugins that offer no component (observers of the event hooks) are listed
    after the components with the hooks they implement. A plugin whose hook
    raised or returned junk is listed as failed beside the healthy ones; a name
    two plugins offer is listed as a conflict (selecting it is an error).
    """
    rows, failed, conflicts, loaded = _plugin_rows(kind)
    if as_json:
        click.echo(json.dumps({"components": rows, "failed": failed, "conflicts": conflicts,
                               "plugins": loaded}, indent=2))
        return
    headers = ("kind", "name", "plugin", "distribution", "version", "summary")
    table = [[str(r[h] or "") for h in headers] for r in rows]
    widths = [max([len(h)] + [len(row[i]) for row in table]) for i, h in enumerate(headers)]
    widths[-1] = len(headers[-1])  # the summary column runs free
    click.echo("  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip())
    for row in table:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    if not rows:
        click.echo("(no components: is MESHKIT_PLUGINS set to an empty list?)")
    providers = {r["plugin"] for r in rows} | {f["plugin"] for f in failed} | {
        p["plugin"] for c in conflicts for p in c["providers"]}
    for p in loaded:
        if p["plugin"] in providers or kind is not None:
            continue
        source = f" ({p['distribution']} {p['version']})" if p["distribution"] else ""
        hooks = ", ".join(p["hooks"]) or "no hooks"
        click.echo(f"observer  {p['plugin']}{source}: {hooks}")
    for f in failed:
        source = f" ({f['distribution']} {f['version']})" if f["distribution"] else ""
        click.echo(f"failed  {f['plugin']}{source}: {f['error']}")
    for c in conflicts:
        click.echo(f"conflict  {c['error']}")


@main.command("check")
@click.argument("config", type=click.Path(dir_okay=False))
def check_command(config: str) -> None:
    """Validate CONFIG, resolve every named component, print the plan.

    Components are built and the strategy's own checks run, so `check` refuses
    everything `run` would refuse before starting a process.
    """
    from meshkit.config import check
    from meshkit.train.runner import build_components

    plan = check(config)
    build_components(plan)
    for line in plan.describe():
        click.echo(line)
    click.echo("ok")


def _register_optional_commands() -> None:
    """Commands defined next to the code they drive (kept out of this module's imports)."""
    import importlib

    for module, names in (("meshkit.cli.node", ("node",)),
                          ("meshkit.cli.run", ("run", "coordinator"))):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name == module:
                continue
            raise
        for name in names:
            command = getattr(mod, name, None)
            if command is not None:
                main.add_command(command)


_register_optional_commands()


if __name__ == "__main__":  # pragma: no cover
    main()
