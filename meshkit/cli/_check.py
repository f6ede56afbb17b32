"""``meshkit check``: refuse everything ``meshkit run`` would refuse, before any process starts."""

from __future__ import annotations

import click

from meshkit.config import check
from meshkit.train import build_components

__all__ = ["check_command"]


@click.command("check")
@click.argument("config", type=click.Path(dir_okay=False))
def check_command(config: str) -> None:
    """Validate CONFIG, resolve every named component, print the plan.

    Components are built and the strategy's own checks run, so `check` refuses
    everything `run` would refuse before starting a process.
    """
    plan = check(config)
    build_components(plan)
    for line in plan.describe():
        click.echo(line)
    click.echo("ok")
