"""Built-in exporters: ``safetensors`` and ``torch``, selected by ``meshkit export --format``.

Written as a third-party plugin would be (meshkit's public API only). Each
exporter's library is imported when it exports, never when the records are
listed or an exporter is built: ``meshkit export --format safetensors`` runs
on numpy alone even where torch is installed (importing torch costs seconds).

* ``safetensors``: the Hugging Face format, written with numpy
  (:mod:`meshkit.safetensors`); ``safetensors.numpy.load_file`` and
  ``safetensors.torch.load_file`` read it. bfloat16 kept, integer buffers in
  their own dtype, JSON leaves in ``__metadata__``.
* ``torch``: a ``torch.save`` state_dict (:func:`meshkit.torch.export`), which
  ``torch.load(FILE, weights_only=True)`` reads; needs the ``torch`` extra.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import meshkit

__all__ = ["SafetensorsExporter", "TorchExporter", "meshkit_exporters"]


class SafetensorsExporter:
    """The run's model as a safetensors file, with numpy alone."""

    def export(self, source: str | os.PathLike[str], file: str | os.PathLike[str]) -> Path:
        from meshkit import safetensors

        return safetensors.export(source, file)


class TorchExporter:
    """The run's model as a ``torch.save`` state_dict (extra ``torch``)."""

    def export(self, source: str | os.PathLike[str], file: str | os.PathLike[str]) -> Path:
        try:
            import meshkit.torch as meshkit_torch
        except ImportError as exc:
            raise meshkit.RefusedError(
                f"meshkit export --format torch needs PyTorch ({exc}): pip install "
                f"'meshkit[torch]'; --format safetensors needs only numpy, and "
                f"safetensors.torch.load_file reads its files into torch") from None
        return meshkit_torch.export(source, file)


@meshkit.hookimpl
def meshkit_exporters() -> Iterable[meshkit.Component]:
    return [
        meshkit.Component("safetensors", SafetensorsExporter,
                          summary="read it with safetensors.numpy.load_file or "
                                  "safetensors.torch.load_file"),
        meshkit.Component("torch", TorchExporter,
                          summary="a state_dict; read it with torch.load(FILE, "
                                  "weights_only=True) (extra torch)"),
    ]
