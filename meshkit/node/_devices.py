"""Which compute devices a node has, found without paying for torch when it is not wanted.

Rule: ``cpu`` is always present. ``cuda:N`` and ``mps`` are only known
through torch, and importing torch costs a numpy-only node one to two
seconds at every start. So torch is asked (:func:`present_devices`) only
when it is installed *and* one of these holds:

* it is imported already (a torch task, or the user's code, loaded it);
* the node's ``--device`` names a non-cpu device (``cuda``, ``cuda:1``,
  ``mps``): the user said the node has one, so it is checked;
* the caller says the work is torch's (``probe=True``).

``--device auto`` on a node where torch has not been imported therefore
advertises ``cpu`` only; start a GPU node with ``--device cuda`` (or import
torch first) to advertise its GPUs. A device the node asks for and does not
have is a :class:`~meshkit.ConfigError` before it joins.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from typing import Any, Sequence

from meshkit.errors import ConfigError

__all__ = ["present_devices", "check_device", "device_matches", "task_device"]

log = logging.getLogger(__name__)

#: Directives that ask for no particular device.
_CPU_LIKE = ("auto", "cpu", "")


def _torch_installed() -> bool:
    return "torch" in sys.modules or importlib.util.find_spec("torch") is not None


def wants_torch(device: str) -> bool:
    """Whether ``device`` (a ``--device`` directive) can only be checked through torch."""
    return device.strip().lower() not in _CPU_LIKE


def present_devices(device: str = "auto", *, probe: bool = False) -> tuple[str, ...]:
    """The devices this process has: ``("cpu", "cuda:0", ..., "mps")`` (module docstring).

    A torch that is installed but fails to import, or a CUDA / MPS back-end
    that raises when asked, is a :class:`~meshkit.ConfigError` when ``device``
    names a device only it could provide; otherwise a warning is logged with
    the error and the node advertises what does work (``cpu``).
    """
    found = ["cpu"]
    if not (probe or "torch" in sys.modules or wants_torch(device)) or not _torch_installed():
        return tuple(found)
    wanted = device.strip().lower()
    try:
        import torch  # heavy optional dependency: only here, only when asked (docstring)
    except Exception as exc:  # a broken install: refused if it was asked for, else logged
        _unusable("torch", exc, asked=wants_torch(device))
        return tuple(found)

    def cuda() -> list[str]:
        if not torch.cuda.is_available():
            return []
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]

    def mps() -> list[str]:
        backend = getattr(torch.backends, "mps", None)  # absent from some builds
        return ["mps"] if backend is not None and backend.is_available() else []

    for name, ask in (("CUDA", cuda), ("MPS", mps)):
        try:
            found += ask()
        except Exception as exc:  # a driver error: refused if asked for, else logged
            _unusable(name, exc, asked=wanted.startswith(name.lower()))
    return tuple(found)


def _unusable(what: str, exc: Exception, *, asked: bool) -> None:
    """``what`` is installed but raised ``exc``: refuse if the node asked for it, else warn."""
    problem = f"{what} is installed but failed: {type(exc).__name__}: {exc}"
    if asked:
        raise ConfigError(f"{problem}; fix the {what} set-up, or start this node with "
                          f"--device cpu") from exc
    log.warning("%s; this node advertises no %s device", problem, what)


def device_matches(wanted: str, devices: Sequence[str]) -> bool:
    """Whether ``devices`` has ``wanted``: ``cuda`` matches any ``cuda:N``, ``cuda:1`` only itself."""
    wanted = wanted.strip().lower()
    if wanted in ("", "auto"):
        return True
    return any(d == wanted or d.startswith(wanted + ":") for d in devices)


def check_device(device: str, devices: Sequence[str]) -> None:
    """Refuse a ``--device`` this node does not have (``auto`` is always fine)."""
    if not device_matches(device, devices):
        raise ConfigError(
            f"--device {device!r}: this node has no such device (found: {', '.join(devices)}"
            f"{'' if _torch_installed() else '; torch is not installed, so only cpu is known'}"
            f"); use --device auto or one of those")


def task_device(node_device: str, required: str, devices: Sequence[str]) -> str:
    """The device a node's task runs on: its own ``--device``, else the run's required one, else ``auto``.

    A required device class (``cuda``) becomes this node's first such device
    (``cuda:0``), so every rank's task is handed a device it really has.
    """
    if node_device.strip().lower() not in ("", "auto"):
        return node_device
    if required.strip().lower() not in ("", "auto"):
        for d in devices:
            if device_matches(required, [d]):
                return d
        return required
    return "auto"


