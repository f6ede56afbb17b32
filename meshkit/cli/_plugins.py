"""``meshkit plugins``: every discovered component, the observers, and the failures.

Listing builds no component, so it stays fast wherever meshkit is
installed: no plugin's heavy code (numpy, torch) loads here.
"""

from __future__ import annotations

import json
from typing import Any

import click

from meshkit import plugins
from meshkit.components import KINDS

__all__ = ["plugins_command"]


def _plugin_rows(kind: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                                            list[dict[str, Any]], list[dict[str, Any]]]:
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


@click.command("plugins")
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
