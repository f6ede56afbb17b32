"""The ``loopback`` board: a fixed-function stage computed in software.

It behaves like a host driver for real hardware would: it knows its
descriptor, emulates the datapath's dtype by rounding inputs and outputs to
it, and computes exactly one function. Every fixed-function path (placement,
length checks, deadlines) can therefore run on a dev machine or in CI with no
FPGA attached.
"""

from __future__ import annotations

import importlib
import reprlib
from pathlib import Path
from typing import Any, Callable

import numpy as np

import meshkit
from meshkit import BoardError, ConfigError

__all__ = ["LoopbackBoard", "resolve_callable"]


def resolve_callable(spec: str, *, where: str) -> Callable[[np.ndarray], Any]:
    """Import ``"module:function"``; a :class:`ConfigError` naming ``where`` otherwise."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{where}: expected 'module:function', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{where}: cannot import module {module_name!r}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 (the module itself is broken: say so, no traceback)
        raise ConfigError(f"{where}: cannot import module {module_name!r}: "
                          f"{type(exc).__name__}: {exc}") from None
    target: Any = module
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ConfigError(f"{where}: module {module_name!r} has no attribute {attr!r}")
    if not callable(target):
        raise ConfigError(f"{where}: {spec!r} is not callable")
    return target


def _load_npy(path: str, expected: tuple[int, ...], what: str) -> np.ndarray:
    file = Path(path).expanduser()
    try:
        # allow_pickle=False: an .npy with object arrays would run code on load.
        array = np.load(file, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"[board] {what}: cannot load {str(file)!r}: {exc}") from None
    if not isinstance(array, np.ndarray):
        # np.load returns an NpzFile (a lazy archive, holding the file open)
        # for .npz: not one array, and it has no shape to check.
        close = getattr(array, "close", None)
        if callable(close):
            close()
        raise ConfigError(
            f"[board] {what}: {str(file)!r} is an .npz archive, expected one array saved "
            f"with numpy.save (.npy)")
    if array.dtype.kind not in "biuf":
        raise ConfigError(
            f"[board] {what}: {str(file)!r} holds dtype {array.dtype}, expected real "
            f"numbers (float32 is what the datapath uses)")
    if array.shape != expected:
        raise ConfigError(
            f"[board] {what}: {str(file)!r} has shape {array.shape}, expected {expected} "
            f"(input_elems, output_elems for weights; output_elems for bias)")
    return np.ascontiguousarray(array, dtype=np.float32)


def _dtype_rounder(dtype: str) -> Callable[[np.ndarray], np.ndarray] | None:
    """How values are rounded to the synthesized datapath's element type."""
    if dtype == "float32":
        return None
    if dtype == "bfloat16":
        import ml_dtypes

        np_dtype = np.dtype(ml_dtypes.bfloat16)
    else:
        np_dtype = np.dtype(dtype)
    if np.issubdtype(np_dtype, np.integer):
        info = np.iinfo(np_dtype)

        def to_int(v: np.ndarray) -> np.ndarray:
            # Fixed-point datapaths saturate rather than wrap.
            return np.clip(np.rint(v), info.min, info.max).astype(np.float32)

        return to_int
    return lambda v: v.astype(np_dtype).astype(np.float32)


class LoopbackBoard:
    """A board driver whose datapath is a numpy function."""

    def __init__(self, descriptor: meshkit.FixedFunction,
                 function: Callable[[np.ndarray], Any], *, deadline: float = 10.0,
                 name: str = "identity") -> None:
        self.descriptor = descriptor
        self.deadline = deadline
        self.function_name = name
        self._function = function
        self._round = _dtype_rounder(descriptor.dtype)

    @classmethod
    def from_options(cls, options: Any) -> LoopbackBoard:
        try:
            ff = meshkit.FixedFunction(options.stage_id, options.input_elems,
                                       options.output_elems, options.dtype)
        except (TypeError, ValueError) as exc:  # attrs validators: an empty id, a bad dtype
            raise ConfigError(f"[board] {exc.args[0] if exc.args else exc}") from None
        n_in, n_out = ff.input_elems, ff.output_elems
        function: Callable[[np.ndarray], Any]
        if options.function in ("identity", "scale"):
            if n_in != n_out:
                raise ConfigError(
                    f"[board] function: {options.function!r} keeps the length, but "
                    f"input_elems={n_in} and output_elems={n_out}; use 'affine' or a "
                    f"'module:function' to change it")
            if options.function == "identity":
                function = np.copy
            else:
                scale = np.float32(options.scale)
                function = lambda x: np.multiply(x, scale, dtype=np.float32)  # noqa: E731
        elif options.function == "affine":
            if not options.weights:
                raise ConfigError(
                    "[board] weights: function 'affine' needs weights = a .npy file of "
                    f"shape ({n_in}, {n_out})")
            weights = _load_npy(options.weights, (n_in, n_out), "weights")
            bias = _load_npy(options.bias, (n_out,), "bias") if options.bias else None

            def function(x: np.ndarray) -> np.ndarray:
                y = x @ weights
                if bias is not None:
                    np.add(y, bias, out=y)
                return y
        else:
            function = resolve_callable(options.function, where="[board] function")
        return cls(ff, function, deadline=options.deadline, name=options.function)

    def execute(self, x: np.ndarray) -> np.ndarray:
        """One activation through the emulated datapath.

        The input length is checked here, as a real host driver would before
        clocking data into the fabric; the output length is checked by the
        node driver against the descriptor (so a wrong ``module:function``
        is caught there, naming both sizes).
        """
        ff = self.descriptor
        x = np.asarray(x, dtype=np.float32).reshape(-1)
        if x.size != ff.input_elems:
            raise BoardError(
                f"loopback board for stage [{ff.stage_id}] takes {ff.input_elems} elements, "
                f"got {x.size}: the datapath is synthesized for one shape")
        # The datapath function gets its own copy: the caller's activation is
        # never modified, whatever a user function does.
        x = self._round(x) if self._round is not None else x.copy()
        value = self._function(x)
        y = np.asarray(value) if value is not None else None
        # asarray(None, float32) is [nan]: a function that forgot to return
        # must be an error, not a NaN result.
        if y is None or (y.dtype.kind not in "biuf"
                         and not y.dtype.type.__module__.startswith("ml_dtypes")):
            raise BoardError(
                f"loopback board for stage [{ff.stage_id}]: {self.function_name} returned "
                f"{reprlib.repr(value)}, expected numbers ({ff.output_elems} values)")
        y = np.asarray(y, dtype=np.float32).reshape(-1)
        if self._round is not None:
            y = self._round(y)
        return y
