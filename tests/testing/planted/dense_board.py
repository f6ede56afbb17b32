"""``dense``: a board computing ``y = W x + b`` on a square stage; and ten ways to get it wrong."""

from __future__ import annotations

from typing import Any

import numpy as np

import meshkit
from meshkit.node import FixedFunction

N = 8
_RNG = np.random.default_rng(42)
W = _RNG.standard_normal((N, N)).astype(np.float32)
B = _RNG.standard_normal(N).astype(np.float32)


def reference(x: np.ndarray) -> np.ndarray:
    return W.astype(np.float64) @ x.astype(np.float64) + B.astype(np.float64)


class DenseBoard:
    """The correct driver."""

    def __init__(self) -> None:
        self.descriptor = FixedFunction("fc", N, N, "float32")

    def check(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32).reshape(-1)
        if x.size != N:
            raise meshkit.BoardError(f"dense board takes {N} values, got {x.size}")
        return x

    def compute(self, x: np.ndarray) -> np.ndarray:
        return W @ x + B

    def execute(self, x: np.ndarray) -> np.ndarray:
        return self.compute(self.check(x))


class AliasedOutput(DenseBoard):
    def __init__(self) -> None:
        super().__init__()
        self._out = np.empty(N, np.float32)  # the DMA buffer, handed out every call

    def compute(self, x):
        np.matmul(W, x, out=self._out)
        self._out += B
        return self._out


class TransposedWeights(DenseBoard):
    def compute(self, x):
        return W.T @ x + B


class WritesIntoItsInput(DenseBoard):
    def execute(self, x):
        y = self.compute(self.check(x))
        x[...] = y  # reuses the caller's buffer for the result
        return x


class ReturnsItsScratch(DenseBoard):
    """Computes in place in the float32 view of the input it was given."""

    def compute(self, x):
        x[...] = W @ x + B
        return x


class Float64Out(DenseBoard):
    def compute(self, x):
        return W.astype(np.float64) @ x + B


class PadsShortInputs(DenseBoard):
    def check(self, x):
        x = np.asarray(x, dtype=np.float32).reshape(-1)
        return np.resize(x, N)


class RaisesValueError(DenseBoard):
    def check(self, x):
        x = np.asarray(x, dtype=np.float32).reshape(-1)
        if x.size != N:
            raise ValueError(f"dense board takes {N} values, got {x.size}")
        return x


class SaysNothingUseful(DenseBoard):
    def check(self, x):
        x = np.asarray(x, dtype=np.float32).reshape(-1)
        if x.size != N:
            raise meshkit.BoardError("bad activation")
        return x


class Dithers(DenseBoard):
    """Adds unseeded dither noise, as an analog front end might."""

    def compute(self, x):
        return W @ x + B + np.random.default_rng().normal(0, 1e-3, N).astype(np.float32)


class ForgetsTheBias(DenseBoard):
    def compute(self, x):
        return W @ x


MISTAKES: dict[str, Any] = {
    "aliased output buffer": AliasedOutput,
    "transposed square weights": TransposedWeights,
    "writes the result into its input": WritesIntoItsInput,
    "computes in place in its input": ReturnsItsScratch,
    "float64 output": Float64Out,
    "pads a short activation": PadsShortInputs,
    "ValueError instead of a MeshError": RaisesValueError,
    "refusal without the sizes": SaysNothingUseful,
    "nondeterministic output": Dithers,
    "missing bias": ForgetsTheBias,
}
