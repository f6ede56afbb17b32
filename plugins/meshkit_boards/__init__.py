"""Built-in board drivers: ``loopback``, a software stand-in for an FPGA stage.

Importing this module is cheap (no numpy): the factory imports the driver
lazily, so ``meshkit plugins`` lists boards without touching numpy.
"""

from __future__ import annotations

import attrs

import meshkit
from meshkit.options import finite

__all__ = ["LoopbackOptions", "meshkit_boards"]

_FUNCTIONS = "'identity', 'scale', 'affine' or 'module:function'"
#: The datapath dtypes a board may emulate (meshkit.FixedFunction's).
_DTYPES = ("float32", "float16", "bfloat16", "int8", "uint8", "int16", "int32")


def _function(instance: object, attribute: object, value: str) -> None:
    if value in ("identity", "scale", "affine") or (":" in value and value.count(":") == 1
                                                     and all(value.split(":"))):
        return
    raise ValueError(f"function must be {_FUNCTIONS}, got {value!r}")


@attrs.frozen
class LoopbackOptions:
    """Options of the ``loopback`` board (its config keys)."""

    #: The pre-synthesized stage this board implements.
    stage_id: str = attrs.field(validator=attrs.validators.min_len(1))
    #: Elements it consumes per activation.
    input_elems: int = attrs.field(validator=attrs.validators.gt(0))
    #: Elements it produces per activation.
    output_elems: int = attrs.field(validator=attrs.validators.gt(0))
    #: Datapath dtype the board emulates (inputs and outputs are rounded to it).
    dtype: str = attrs.field(default="float32", validator=attrs.validators.in_(_DTYPES))
    #: What it computes: identity, scale, affine (weights from .npy) or module:function.
    function: str = attrs.field(default="identity", validator=_function)
    #: Factor for ``function = "scale"``.
    scale: float = attrs.field(default=1.0, validator=finite)
    #: ``.npy`` file of shape (input_elems, output_elems) for ``function = "affine"``.
    weights: str = ""
    #: Optional ``.npy`` file of shape (output_elems,) added after the affine map.
    bias: str = ""
    #: Seconds one activation may take before the board counts as hung.
    deadline: float = attrs.field(default=10.0, validator=attrs.validators.gt(0))


def _build_loopback(options: LoopbackOptions) -> object:
    from meshkit_boards.loopback import LoopbackBoard

    return LoopbackBoard.from_options(options)


@meshkit.hookimpl
def meshkit_boards() -> list[meshkit.Component]:
    return [
        meshkit.Component(
            "loopback", _build_loopback, LoopbackOptions,
            summary="software stand-in for a fixed-function board "
                    "(identity, scale, affine from .npy, or module:function)"),
    ]
