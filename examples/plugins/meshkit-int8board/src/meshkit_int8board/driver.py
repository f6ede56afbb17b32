"""The host driver and the simulated device behind it.

A real driver would map the card's BARs and DMA buffers; here
:class:`SimulatedDevice` holds the same buffers as numpy arrays and "runs"
the synthesized datapath when the doorbell rings. Everything the host does
(checking sizes, quantizing, reading back, dequantizing) is what a driver
for real hardware does.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

import meshkit
from meshkit.node.board import BoardError

__all__ = ["Int8Board", "SimulatedDevice"]

log = logging.getLogger(__name__)

INT8_MIN, INT8_MAX = -128, 127


class SimulatedDevice:
    """The card: int8 weights burned in, an int8 input buffer, an int32 output buffer."""

    def __init__(self, weights: np.ndarray) -> None:
        # What synthesis baked in: an int8 matrix, widened once for the MACs.
        output_elems, input_elems = weights.shape
        self.weights = weights
        self._weights32 = self.weights.astype(np.int32)
        self.input_buffer = np.zeros(input_elems, dtype=np.int8)
        self.output_buffer = np.zeros(output_elems, dtype=np.int32)
        self._input32 = np.zeros(input_elems, dtype=np.int32)

    def ring_doorbell(self) -> None:
        """Run the datapath once: int8 x int8 products, int32 accumulation."""
        np.copyto(self._input32, self.input_buffer)
        np.matmul(self._weights32, self._input32, out=self.output_buffer)


def _bitstream_weights(options: Any) -> np.ndarray:
    """The int8 weight matrix the (simulated) bitstream implements."""
    shape = (options.output_elems, options.input_elems)
    if not options.weights:
        rng = np.random.default_rng(options.weight_seed)
        return rng.integers(INT8_MIN, INT8_MAX + 1, shape, dtype=np.int8)
    try:
        # allow_pickle=False: an .npy holding objects would run code on load.
        weights = np.load(options.weights, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise meshkit.ConfigError(
            f"[board] weights: cannot load {options.weights!r}: {exc}") from None
    if weights.dtype != np.int8 or weights.shape != shape:
        raise meshkit.ConfigError(
            f"[board] weights: {options.weights!r} holds {weights.dtype}{list(weights.shape)}; "
            f"the datapath needs int8[{shape[0]}, {shape[1]}] (output_elems, input_elems)")
    return weights


class Int8Board:
    """Host driver for the int8 datapath: the object meshkit's board contract talks to."""

    def __init__(self, options: Any) -> None:
        self.descriptor = meshkit.FixedFunction(
            options.stage_id, options.input_elems, options.output_elems, "int8")
        self.deadline = options.deadline
        self.scale = float(options.scale)
        self._out_scale = np.float32(options.scale * options.weight_scale)
        self._device = SimulatedDevice(_bitstream_weights(options))
        # Preallocated host staging buffer: no allocation per activation.
        self._staging = np.empty(options.input_elems, dtype=np.float32)
        self._lock = threading.Lock()
        #: Input values clipped to the int8 range so far (a sign `scale` is too small).
        self.saturated = 0

    def execute(self, x: Any) -> np.ndarray:
        d = self.descriptor
        x = np.asarray(x)
        # The datapath reads exactly input_elems values from its buffer; any
        # other length would be silently truncated or padded with stale data.
        if x.ndim != 1 or x.size != d.input_elems:
            raise BoardError(
                f"int8 board for stage [{d.stage_id}]: expected an activation of "
                f"{d.input_elems} values (1-D), got shape {x.shape} with {x.size} values; "
                f"the datapath is synthesized for {d.input_elems}")
        if x.dtype.kind not in "fiu":
            raise BoardError(
                f"int8 board for stage [{d.stage_id}]: expected float32 activations, "
                f"got dtype {x.dtype}")
        with self._lock:
            staging = self._staging
            np.divide(x, self.scale, out=staging, casting="unsafe")
            if not np.isfinite(staging).all():
                raise BoardError(
                    f"int8 board for stage [{d.stage_id}]: the activation holds NaN or inf "
                    f"(after dividing by scale={self.scale:g}), which int8 cannot represent")
            np.rint(staging, out=staging)
            clipped = int(np.count_nonzero((staging < INT8_MIN) | (staging > INT8_MAX)))
            if clipped:
                self.saturated += clipped
                log.debug("stage [%s]: %d input values saturated at scale=%g",
                          d.stage_id, clipped, self.scale)
            np.clip(staging, INT8_MIN, INT8_MAX, out=staging)
            np.copyto(self._device.input_buffer, staging, casting="unsafe")
            self._device.ring_doorbell()
            y = self._device.output_buffer.astype(np.float32)
        np.multiply(y, self._out_scale, out=y)
        return y

    def close(self) -> None:
        """Nothing to release on a simulated card (a real one unmaps its BARs here)."""
