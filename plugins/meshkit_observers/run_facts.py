"""What a tracker records about a run: its config as params and text, a round as scalars.

Shared by the observers so TensorBoard and MLflow show the same names.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import attrs

__all__ = ["config_params", "config_text", "round_scalars", "run_name"]


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}", inner, out)
    elif isinstance(value, (list, tuple)):
        out[prefix] = json.dumps(list(value))
    else:
        out[prefix] = value


def config_params(config: Any) -> dict[str, Any]:
    """The config as flat ``table.key`` params: ``run.seed``, ``strategy.rounds``, ``task.hidden``.

    ``[[observers]]`` entries are left out: they say how the run is watched,
    not what it is.
    """
    params: dict[str, Any] = {}
    for table in ("run", "mesh"):
        value = getattr(config, table, None)
        if value is not None and attrs.has(type(value)):
            _flatten(table, attrs.asdict(value), params)
    selections = getattr(config, "selections", None)
    for selection in (selections() if callable(selections) else []):
        table = "task" if selection.kind == "task" else selection.kind
        params[f"{table}.name"] = selection.name
        _flatten(table, dict(selection.options), params)
    return params


def config_text(config: Any) -> str:
    """The config as a person wrote it: the TOML file when there is one, else its params."""
    path = Path(str(getattr(config, "path", "")))
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            pass  # the params below say the same, less prettily
    return json.dumps(config_params(config), indent=2, sort_keys=True, default=str)


def run_name(config: Any) -> str:
    """The run's name: the last part of ``[run] out``."""
    out = str(getattr(getattr(config, "run", None), "out", "") or "meshkit")
    return Path(out).name or "meshkit"


def round_scalars(report: Any) -> dict[str, float]:
    """A round's numbers: every finite numeric metric, and ``round/examples``, ``round/seconds``."""
    scalars: dict[str, float] = {}
    for key, value in dict(getattr(report, "metrics", {}) or {}).items():
        if isinstance(value, bool):
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue  # a string or a list is a report, not a curve
        if math.isfinite(number):
            scalars[str(key)] = number
    scalars["round/examples"] = float(getattr(report, "examples", 0) or 0)
    scalars["round/seconds"] = float(getattr(report, "seconds", 0.0) or 0.0)
    return scalars
