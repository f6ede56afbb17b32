"""What a pipeline stage computes: :class:`Stage`, its ops, and its wire form.

A stage is one step of a pipeline: an op a worker runs (the table in
:mod:`meshkit.pipeline`), or a *board stage* only fixed-function hardware
implementing its ``stage_id`` runs. Every op's rule, the check of a stage
when it is built or arrives in a job message, and :func:`run_local` (the
in-process reference a mesh run must match) are here.
"""

from __future__ import annotations

import importlib
from typing import Any, Iterable, Mapping, Sequence

import attrs
import numpy as np

from meshkit.errors import BoardError, ConfigError, MeshError, PlacementError, WireError
from meshkit.node import as_activation

__all__ = ["OPS", "Stage", "run_local"]

#: Ops a worker stage may name (None: a board stage).
OPS = ("identity", "scale", "relu", "tanh", "affine", "call")
_ACTIVATIONS = (None, "relu", "tanh")
_PARAM = "param."


def _as_weights(value: Any) -> np.ndarray | None:
    return None if value is None else np.ascontiguousarray(value, dtype=np.float32)


@attrs.frozen(eq=False)
class Stage:
    """One pipeline stage (see the module docstring for the ops)."""

    op: str | None = "identity"
    stage_id: str | None = None
    scale: float = 1.0
    function: str | None = None
    activation: str | None = None
    weights: np.ndarray | None = attrs.field(default=None, repr=False)
    bias: np.ndarray | None = attrs.field(default=None, repr=False)
    _fn: Any = attrs.field(default=None, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        where = f"stage [{self.stage_id}]" if self.stage_id else "stage"
        if self.op is None:
            if not self.stage_id:
                raise ConfigError(
                    "a board stage (op None) must set stage_id: it names the "
                    "pre-synthesized stage a fixed-function rank implements")
            return
        if self.op not in OPS:
            raise ConfigError(f"{where}: op must be one of {', '.join(OPS)} (or None for a "
                              f"board stage), got {self.op!r}")
        if self.activation not in _ACTIVATIONS:
            raise ConfigError(f"{where}: activation must be 'relu', 'tanh' or None, "
                              f"got {self.activation!r}")
        if self.op == "affine":
            w = self.weights
            if w is None or w.ndim != 2:
                raise ConfigError(
                    f"{where}: op 'affine' needs weights of shape (in, out), got "
                    f"{None if w is None else w.shape}")
            if self.bias is not None and self.bias.shape != (w.shape[1],):
                raise ConfigError(
                    f"{where}: bias has shape {self.bias.shape}, expected ({w.shape[1]},) "
                    f"to match weights {w.shape}")
            object.__setattr__(self, "weights", _as_weights(w))
            object.__setattr__(self, "bias", _as_weights(self.bias))
        if self.op == "call" and not (self.function and self.function.count(":") == 1):
            raise ConfigError(f"{where}: op 'call' needs function = 'module:function', "
                              f"got {self.function!r}")

    # -- constructors --------------------------------------------------------

    @classmethod
    def board(cls, stage_id: str) -> Stage:
        """A stage only fixed-function hardware implementing ``stage_id`` runs."""
        return cls(op=None, stage_id=stage_id)

    @classmethod
    def affine(cls, weights: Any, bias: Any = None, *, activation: str | None = None,
               stage_id: str | None = None) -> Stage:
        return cls(op="affine", weights=np.asarray(weights, dtype=np.float32),
                   bias=None if bias is None else np.asarray(bias, dtype=np.float32),
                   activation=activation, stage_id=stage_id)

    @property
    def input_elems(self) -> int | None:
        """Elements this stage consumes, when its op fixes it."""
        return int(self.weights.shape[0]) if self.op == "affine" and self.weights is not None \
            else None

    @property
    def output_elems(self) -> int | None:
        return int(self.weights.shape[1]) if self.op == "affine" and self.weights is not None \
            else None

    def describe(self) -> str:
        if self.op is None:
            return f"board stage [{self.stage_id}]"
        label = f" [{self.stage_id}]" if self.stage_id else ""
        return f"{self.op} stage{label}"

    # -- running -------------------------------------------------------------

    def run(self, x: np.ndarray) -> np.ndarray:
        """Compute this stage on one activation (a worker's side)."""
        x = np.asarray(x, dtype=np.float32).reshape(-1)
        op = self.op
        if op is None:
            raise PlacementError(
                f"{self.describe()} runs only on fixed-function hardware implementing it")
        if op == "identity":
            return x
        if op == "scale":
            return np.multiply(x, np.float32(self.scale), dtype=np.float32)
        if op == "relu":
            return np.maximum(x, np.float32(0))
        if op == "tanh":
            return np.tanh(x)
        if op == "affine":
            assert self.weights is not None
            if x.size != self.weights.shape[0]:
                raise PlacementError(
                    f"{self.describe()} takes {self.weights.shape[0]} elements, got an "
                    f"activation of {x.size}: fix the stage feeding it")
            y = x @ self.weights
            if self.bias is not None:
                np.add(y, self.bias, out=y)
            if self.activation == "relu":
                np.maximum(y, np.float32(0), out=y)
            elif self.activation == "tanh":
                np.tanh(y, out=y)
            return y
        # op == "call"
        fn = self._fn
        if fn is None:
            fn = _import_callable(self.function or "", self.describe())
            object.__setattr__(self, "_fn", fn)
        where = f"{self.describe()}: {self.function}"
        try:
            value = fn(x)
        except MeshError:
            raise
        except Exception as exc:  # the user's function: an error naming it, not a crash
            raise MeshError(f"{where} raised {type(exc).__name__}: {exc}") from exc
        return as_activation(value, where)

    # -- wire form -------------------------------------------------------------

    def to_message(self) -> dict[str, Any]:
        """The stage as a job-message fragment: ``stage`` JSON + ``param.*`` arrays."""
        spec = {"op": self.op, "stage_id": self.stage_id, "scale": float(self.scale),
                "function": self.function, "activation": self.activation}
        message: dict[str, Any] = {"stage": spec}
        if self.weights is not None:
            message[_PARAM + "weights"] = self.weights
        if self.bias is not None:
            message[_PARAM + "bias"] = self.bias
        return message

    @classmethod
    def from_message(cls, message: Mapping[str, Any]) -> Stage:
        """Rebuild a stage from a job message, refusing anything malformed."""
        spec = message.get("stage")
        if not isinstance(spec, Mapping):
            raise WireError("stage message carries no 'stage' object")
        op = spec.get("op")
        stage_id = spec.get("stage_id")
        function = spec.get("function")
        activation = spec.get("activation")
        scale = spec.get("scale", 1.0)
        for name, value in (("op", op), ("stage_id", stage_id), ("function", function),
                            ("activation", activation)):
            if value is not None and not isinstance(value, str):
                raise WireError(f"stage message: {name} must be a string or null, got {value!r}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise WireError(f"stage message: scale must be a number, got {scale!r}")
        arrays = {}
        for name in ("weights", "bias"):
            value = message.get(_PARAM + name)
            if value is not None and not isinstance(value, np.ndarray):
                raise WireError(f"stage message: {_PARAM}{name} must be an array")
            arrays[name] = value
        try:
            return cls(op=op, stage_id=stage_id, scale=float(scale), function=function,
                       activation=activation, **arrays)
        except ConfigError as exc:
            raise WireError(f"stage message: {exc}") from None


def _import_callable(spec: str, where: str) -> Any:
    module_name, _, attr = spec.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{where}: cannot load {spec!r}: {exc}") from None
    if not callable(target):
        raise ConfigError(f"{where}: {spec!r} is not callable")
    return target


def run_local(stages: Sequence[Stage], inputs: Iterable[Any],
              boards: Mapping[str, Any] | None = None) -> list[np.ndarray]:
    """Compute a pipeline in this process (the reference the mesh must match).

    ``boards`` maps a board stage's ``stage_id`` to a board driver.
    """
    outputs = []
    for x in inputs:
        y = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        for stage in stages:
            if stage.op is None:
                if not boards or stage.stage_id is None or stage.stage_id not in boards:
                    raise PlacementError(f"run_local: no board given for {stage.describe()}")
                y = as_activation(boards[stage.stage_id].execute(y),
                                  f"{stage.describe()}: the board", BoardError)
            else:
                y = stage.run(y)
        outputs.append(y)
    return outputs
