"""A run's model back as torch: a state_dict, a loaded module, or a file.

The source is a run directory (its ``checkpoint.npz``, rewritten after every
round, holds the last round's global model) or a checkpoint file. Integer
buffers, which a run carries as float64 counts (see
:mod:`meshkit.torch._convert`), come back rounded in their own dtype, so the
result is exactly what ``model.state_dict()`` would hold.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from meshkit._atomic import atomic_file
from meshkit.checkpoint import checkpoint_path, load_checkpoint
from meshkit.errors import ConfigError
from meshkit.state import is_array
from meshkit.torch._convert import INT_BUFFERS, load_module_state, tensors_from_state

__all__ = ["state_dict", "load", "export"]



def _state(source: str | os.PathLike[str]) -> dict[str, Any]:
    state = dict(load_checkpoint(source).state)
    other = sorted(k for k, v in state.items() if k != INT_BUFFERS and not is_array(v))
    if other:
        raise ConfigError(
            f"{str(checkpoint_path(source))!r}: state keys {', '.join(map(repr, other))} are "
            f"JSON values, not arrays; a torch state_dict holds tensors only (was this run's "
            f"task a torch model?)")
    return state


def state_dict(source: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The run's global model as a state_dict of CPU tensors (sharing the loaded arrays)."""
    return tensors_from_state(_state(source))


def load(source: str | os.PathLike[str], model: torch.nn.Module) -> torch.nn.Module:
    """Load the run's global model into ``model`` strictly; returns ``model``.

    Keys that differ from the model's are a :class:`meshkit.MeshError`
    naming them (never ``strict=False``).
    """
    load_module_state(model, _state(source),
                      where=f"meshkit.torch.load({str(checkpoint_path(source))!r})")
    return model


def export(source: str | os.PathLike[str], file: str | os.PathLike[str]) -> Path:
    """Write the run's global model to ``file`` with ``torch.save``, atomically.

    ``torch.load(file, weights_only=True)`` reads it back: a dict of tensors.
    """
    tensors = state_dict(source)
    target = Path(file)
    with atomic_file(target) as fh:
        torch.save(tensors, fh)
    return target
