"""The exporter contract: what ``meshkit export --format NAME`` asks of a plugin.

An *exporter* (kind ``exporter``, hook ``meshkit_exporters()``) writes a run's
global model in another framework's format::

    exporter.export(source, file) -> Path

``source`` is a run directory (its last checkpoint) or a checkpoint file
(:func:`meshkit.checkpoint.load_checkpoint` reads either); ``file`` is the
output, which the exporter replaces atomically (no torn or partial file when
it fails) and returns. A state the format cannot hold is a
:class:`meshkit.MeshError` naming the key; a format whose library is missing
is a :class:`meshkit.RefusedError` saying what to install and which format
works instead. Building the exporter (its factory) imports nothing heavy and
touches no file: ``meshkit export --format safetensors`` must not pay for
torch because a torch exporter is installed.

Built-ins (``meshkit_exporters``): ``safetensors`` (numpy alone,
:mod:`meshkit.safetensors`) and ``torch`` (``torch.save``; extra ``torch``).
:class:`meshkit.testing.ExporterContract` checks an exporter.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol, runtime_checkable

__all__ = ["Exporter"]


@runtime_checkable
class Exporter(Protocol):
    """Writes a run's global model to a file in one format."""

    def export(self, source: str | os.PathLike[str], file: str | os.PathLike[str]) -> Path:
        """Write the model of run ``source`` to ``file`` (atomically); return the file.

        Raises:
            meshkit.ConfigError: ``source`` holds no readable checkpoint.
            meshkit.MeshError: the state holds a key or value the format cannot.
            meshkit.RefusedError: the format's library is not installed.
            OSError: ``file`` cannot be written.
        """
