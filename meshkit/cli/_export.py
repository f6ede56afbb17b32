"""``meshkit export``: a run's global model written in another framework's format.

The format is an *exporter* plugin (kind ``exporter``, hook
``meshkit_exporters()``, contract :class:`meshkit.exporter.Exporter`) chosen
by name with ``--format``; the built-ins are ``safetensors`` (numpy alone)
and ``torch`` (``torch.save``, extra ``torch``). This command imports no
format library itself: the exporter does, when it writes, so
``--format safetensors`` never pays for importing torch.
"""

from __future__ import annotations

import click

from meshkit import plugins
from meshkit.errors import ConfigError

__all__ = ["export_command"]


@click.command("export")
@click.argument("run", type=click.Path(exists=True))
@click.option("--format", "fmt", default="torch", show_default=True, metavar="NAME",
              help="The exporter to write with: safetensors, torch, or one a plugin offers "
                   "(`meshkit plugins` lists them).")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="The file to write (replaced atomically).")
def export_command(run: str, fmt: str, output: str) -> None:
    """Write RUN's model in an exporter's format (torch, safetensors, ...).

    RUN is a run directory (its last checkpoint) or a checkpoint file; NAME is
    an exporter: `torch` (a state_dict), `safetensors`, or one a plugin offers.
    """
    # An unknown name is UnknownComponentError, listing the exporters there are.
    exporter = plugins.create("exporter", fmt)
    try:
        path = exporter.export(run, output)
    except OSError as exc:  # the checkpoint is read as ConfigError; this is the output
        where = f"{exc.filename}: " if exc.filename else ""
        raise ConfigError(
            f"meshkit export: cannot write {output!r} ({where}{exc.strerror or exc}); -o must "
            f"name a file in a directory that exists or can be created") from None
    summary = plugins.available("exporter")[fmt].summary
    click.echo(f"wrote {path} ({fmt}" + (f"; {summary})" if summary else ")"))
