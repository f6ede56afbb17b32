"""meshkit.torch: PyTorch models as meshkit tasks, and a run's result back as torch.

Optional (``pip install 'meshkit[torch]'``, or bring your own torch build):
importing :mod:`meshkit` never imports torch; importing this package does.

* :func:`task` — a task from a model factory, a loss, an optimizer factory
  and data (map-style Datasets or arrays); assign it to a module attribute
  and select it as ``[run] task = "module:attribute"``. Its ``[task]`` keys
  are :class:`TorchOptions` (or your subclass of it).
* :func:`to_numpy` / :func:`from_numpy`, :func:`state_from_tensors` /
  :func:`tensors_from_state` — state_dict <-> meshkit state without copies
  for CPU tensors, dtypes kept; the integer-buffer rule is in
  :mod:`meshkit.torch._convert` (and docs/torch.md).
* :func:`load` / :func:`state_dict` / :func:`export` — a run directory or
  checkpoint as a loaded module, a state_dict, or a ``torch.save`` file.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401  (the point of this package; fail here with the fix)
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError(
        f"meshkit.torch needs PyTorch, which is not importable here ({exc}). Install it "
        f"with pip install 'meshkit[torch]', or your platform's torch build first") from exc

from meshkit.torch._convert import (
    INT_BUFFERS,
    check_keys,
    from_numpy,
    load_module_state,
    module_state,
    state_from_tensors,
    tensors_from_state,
    to_numpy,
)
from meshkit.torch._options import TorchOptions
from meshkit.torch._results import export, load, state_dict
from meshkit.torch._task import NORM_LAYERS, TorchTask, is_lora_key, pick_device, task

__all__ = [
    "task",
    "TorchTask",
    "TorchOptions",
    "pick_device",
    "NORM_LAYERS",
    "is_lora_key",
    "INT_BUFFERS",
    "to_numpy",
    "from_numpy",
    "state_from_tensors",
    "tensors_from_state",
    "module_state",
    "load_module_state",
    "check_keys",
    "load",
    "state_dict",
    "export",
]
