"""meshkit: a pluggable kernel for training and serving models across a mesh.

Importing meshkit is cheap: it loads no plugin and no numpy. Heavier public
names (``NodeConfig``, ``FixedFunction``, ...) load on first attribute access.
"""

from __future__ import annotations

import importlib
from typing import Any

import pluggy

from meshkit.components import Component, Provenance
from meshkit.errors import (
    AggregationError,
    AuthenticationError,
    BoardError,
    BoardTimeoutError,
    ConfigError,
    DigestMismatchError,
    MeshError,
    PeerLostError,
    PlacementError,
    PluginError,
    ProtocolError,
    RefusedError,
    StateError,
    UnknownComponentError,
    WireError,
    WorkerError,
)

__version__ = "0.1.0"

#: The marker plugins use for hook implementations.
hookimpl = pluggy.HookimplMarker("meshkit")

# Public names that live in modules too heavy to import eagerly.
_LAZY = {
    "NodeConfig": "meshkit.node.config",
    "NodeRole": "meshkit.node",
    "FixedFunction": "meshkit.node",
    "NodeCaps": "meshkit.node",
    "NodeControl": "meshkit.node",
    "NodeReport": "meshkit.node",
    "TrainReport": "meshkit.node",
    "AggregatorTraits": "meshkit.aggregation",
    "CompressionTraits": "meshkit.compression",
    "StrategyContext": "meshkit.train",
    "StrategyTraits": "meshkit.train",
    "RoundReport": "meshkit.train",
    "FitResult": "meshkit.task",
    "serve_node": "meshkit.node",
    "serve_fixed_function": "meshkit.node",
    "serve_worker": "meshkit.pipeline",
    "serve_trainer": "meshkit.train",
    # meshkit.run(config): a path, a mapping or a parsed config -> RunReport.
    "run": "meshkit.train",
}

# Subpackages and modules reachable as attributes after ``import meshkit``
# (``meshkit.plugins.available("aggregator")``), imported on first use.
_SUBMODULES = frozenset({
    "aggregation", "checkpoint", "cli", "config", "exporter", "flower", "hookspecs", "node", "options", "outer",
    "partitioner", "pipeline", "plugins", "registry", "safetensors", "state", "task", "testing",
    "train", "transport",
    "wire", "attack", "population", "simulation", "secure_aggregation", "compression",
})

__all__ = [
    "__version__",
    "hookimpl",
    "Component",
    "Provenance",
    "MeshError",
    "ConfigError",
    "PluginError",
    "UnknownComponentError",
    "RefusedError",
    "AggregationError",
    "PlacementError",
    "WireError",
    "AuthenticationError",
    "PeerLostError",
    "StateError",
    "BoardError",
    "BoardTimeoutError",
    "WorkerError",
    "ProtocolError",
    "DigestMismatchError",
    *_LAZY,
]


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_SUBMODULES})


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"meshkit.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'meshkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
