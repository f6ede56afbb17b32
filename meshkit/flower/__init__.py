"""meshkit.flower: a Flower client, unchanged, as a meshkit task (extra ``flower``).

``meshkit.flower.task(client_fn)`` turns a Flower client factory —
``client_fn(context)`` returning a ``NumPyClient`` (or a ``Client``), a
``ClientApp`` built from one, or a Message-API ``ClientApp`` (``@app.train()``,
``@app.evaluate()``, with ``initial=`` the callable building the initial
model) — into a :class:`meshkit.Component` a config
selects by ``"module:attribute"``; the
registered task ``flower`` does the same from ``[task] app =
"module:attribute"``, so a Flower user's client runs under ``meshkit run``
with only a config file. docs/coming-from-flower.md maps Flower's concepts
onto meshkit's one by one; :mod:`meshkit.flower._task` says how each call is
made.

The options classes load without Flower (``meshkit plugins`` lists the
``flower`` task everywhere); everything else imports ``flwr`` on first use
and says how to install it when it is missing.
"""

from __future__ import annotations

import importlib
from typing import Any

from meshkit.flower._options import AppOptions, FlowerOptions

__all__ = ["AppClient", "AppClientFn", "AppOptions", "FlowerOptions", "FlowerTask", "MessageApp",
           "app_task", "load_client_fn", "task", "to_parameters", "to_state"]

_NEEDS_FLOWER = frozenset({"AppClient", "AppClientFn", "FlowerTask", "MessageApp", "app_task",
                           "load_client_fn", "task", "to_parameters", "to_state"})


def __getattr__(name: str) -> Any:
    if name not in _NEEDS_FLOWER:
        raise AttributeError(f"module 'meshkit.flower' has no attribute {name!r}")
    try:
        module = importlib.import_module("meshkit.flower._task")
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "flwr":
            raise ImportError(f"meshkit.flower.{name} needs Flower: pip install "
                              f"'meshkit[flower]' ({exc})") from exc
        raise
    value = getattr(module, name)
    globals()[name] = value
    return value
