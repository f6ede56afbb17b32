"""meshkit-int8board: a board driver for an int8 fixed-point datapath.

The board (simulated here, so it runs anywhere) implements one
pre-synthesized stage: ``y = W @ x`` with int8 weights baked into the
bitstream, int8 activations and int32 accumulation. The host driver does what
real FPGA host drivers do: checks the activation against the descriptor,
quantizes it on the host with the configured ``scale``, writes it to the
device's input buffer, rings the doorbell and dequantizes the result::

    [board]
    name = "int8"
    stage_id = "mlp.0"
    input_elems = 64
    output_elems = 10
    scale = 0.05

This module is imported to list plugins, so numpy loads only when a board is
built.
"""

from __future__ import annotations

from typing import Any, Iterable

import attrs

import meshkit

__all__ = ["Int8BoardOptions", "meshkit_boards"]
__version__ = "0.1.0"

_positive = attrs.validators.gt(0)


@attrs.frozen
class Int8BoardOptions:
    """The ``[board]`` keys the ``int8`` driver accepts."""

    #: The pre-synthesized stage the bitstream implements.
    stage_id: str
    #: Activation length the datapath was synthesized for.
    input_elems: int = attrs.field(validator=_positive)
    #: Output length of the datapath.
    output_elems: int = attrs.field(validator=_positive)
    #: Quantization step of the input: q = clip(round(x / scale), -128, 127).
    scale: float = attrs.field(default=1.0 / 64, validator=_positive)
    #: Fixed-point step of the baked-in int8 weights.
    weight_scale: float = attrs.field(default=1.0 / 64, validator=_positive)
    #: ``.npy`` file of the int8 weights, shape (output_elems, input_elems), as
    #: synthesized into the bitstream; empty: weights drawn from ``weight_seed``.
    weights: str = ""
    #: Seed of the simulated bitstream's weights when ``weights`` is empty.
    weight_seed: int = 0
    #: Seconds one activation may take before the board counts as hung.
    deadline: float = attrs.field(default=5.0, validator=_positive)


def _int8(options: Int8BoardOptions) -> Any:
    from meshkit_int8board.driver import Int8Board

    return Int8Board(options)


@meshkit.hookimpl
def meshkit_boards() -> Iterable[meshkit.Component]:
    return [
        meshkit.Component(
            "int8", _int8, Int8BoardOptions,
            summary="int8 fixed-point matmul datapath (simulated FPGA; host-side "
                    "quantization with `scale`)"),
    ]
