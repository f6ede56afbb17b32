"""``meshkit export``: a run's global model written in another framework's format.

* ``--format torch``: a ``torch.save`` file of the run's last checkpointed
  model, which ``torch.load(FILE, weights_only=True)`` reads as a
  state_dict. torch is optional, so without it the command says how to get it.
* ``--format safetensors``: the Hugging Face format, written with numpy
  alone (:mod:`meshkit.safetensors`); ``safetensors.numpy.load_file`` and
  ``safetensors.torch.load_file`` read it.
"""

from __future__ import annotations

from typing import Any

import click

from meshkit import safetensors
from meshkit.errors import ConfigError

try:  # the torch extra is optional; only --format torch needs it
    import meshkit.torch as meshkit_torch
except ImportError as exc:
    meshkit_torch = None
    _WHY = str(exc)

__all__ = ["export_command"]

FORMATS = ("torch", "safetensors")


@click.command("export")
@click.argument("run", type=click.Path(exists=True))
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="torch",
              show_default=True, help="The file format to write.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="The file to write (replaced atomically).")
def export_command(run: str, fmt: str, output: str) -> None:
    """Write RUN's model as a torch state_dict or a safetensors file.

    RUN is a run directory (its last checkpoint) or a checkpoint file.
    """
    try:
        path = _write(run, fmt, output)
    except OSError as exc:  # the checkpoint is read as ConfigError; this is the output
        where = f"{exc.filename}: " if exc.filename else ""
        raise ConfigError(
            f"meshkit export: cannot write {output!r} ({where}{exc.strerror or exc}); -o must "
            f"name a file in a directory that exists or can be created") from None
    if fmt == "safetensors":
        click.echo(f"wrote {path} (safetensors; read it with safetensors.numpy.load_file or "
                   f"safetensors.torch.load_file)")
    else:
        click.echo(f"wrote {path} ({fmt} state_dict; read it with torch.load(FILE, "
                   f"weights_only=True))")


def _write(run: str, fmt: str, output: str) -> Any:
    if fmt == "safetensors":
        return safetensors.export(run, output)
    if meshkit_torch is None:
        raise ConfigError(f"meshkit export --format torch needs PyTorch: {_WHY}; "
                          f"--format safetensors needs only numpy")
    return meshkit_torch.export(run, output)
