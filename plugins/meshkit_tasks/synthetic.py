"""The ``synthetic`` task: a model of any size whose fit costs next to nothing.

It exists to measure and test what the mesh does with a model, not what a
model learns: ``params`` float parameters of ``dtype``, split over
``arrays`` arrays. A fit is the state plus a perturbation seeded by the
fit's seed and scaled by the shard it was given, so it is a pure function of
(state, shard, seed) -- two workers fitting the same client produce the same
bits -- and different clients produce contributions of different
magnitudes, so the order in which contributions are summed shows in the
result's bits. ``gradients``/``apply`` do the same for data-parallel.
Evaluation needs no held-out data: it reports the model's mean.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from meshkit import ConfigError
from meshkit.state import dtype_from_name
from meshkit.task import FitResult
from meshkit_tasks.options import SyntheticOptions

__all__ = ["SyntheticOptions", "SyntheticTask"]

#: Dtypes the task can build a model in (the float ones a state may hold).
DTYPES = ("float16", "bfloat16", "float32", "float64")


class SyntheticTask:
    """A cheap task of ``params`` parameters (the :class:`meshkit.task.Task` protocol)."""

    Options = SyntheticOptions

    def __init__(self, options: SyntheticOptions | None = None) -> None:
        self.options = opts = options or SyntheticOptions()
        if opts.dtype not in DTYPES:
            raise ConfigError(f"[task] dtype = {opts.dtype!r}: the synthetic task builds "
                              f"float models; use one of {', '.join(DTYPES)}")
        if opts.arrays > opts.params:
            raise ConfigError(f"[task] arrays = {opts.arrays} is more than params = "
                              f"{opts.params}; every array needs at least one parameter")
        self.dtype = dtype_from_name(opts.dtype)
        # float64 models are perturbed in float64, every narrower one in float32.
        self._work = np.dtype(np.float64) if self.dtype == np.float64 else np.dtype(np.float32)
        size, extra = divmod(opts.params, opts.arrays)
        self.sizes = [size + (1 if i < extra else 0) for i in range(opts.arrays)]
        x = (np.arange(opts.rows, dtype=np.float64) / opts.rows).reshape(opts.rows, 1)
        y = np.arange(opts.rows, dtype=np.int64)
        x.setflags(write=False)
        y.setflags(write=False)
        self._data = (x, y)

    def train_data(self) -> tuple[np.ndarray, np.ndarray]:
        return self._data

    def init_state(self, seed: int) -> dict[str, Any]:
        """Uniform values in [-0.5, 0.5), a pure function of ``seed``."""
        rng = np.random.default_rng(seed)
        state = {}
        for i, size in enumerate(self.sizes):
            w = rng.random(size, dtype=self._work)
            w -= 0.5
            state[f"w{i}"] = w.astype(self.dtype, copy=False)
        return state

    def _perturbed(self, state: Mapping[str, Any], seed: int, scale: float,
                   sign: float = 1.0) -> dict[str, Any]:
        """``state + sign * scale * N(0, 1)``, the noise drawn from ``seed``, array by array."""
        rng = np.random.default_rng(seed)
        out = {}
        for i, size in enumerate(self.sizes):
            key = f"w{i}"
            if key not in state:
                raise KeyError(f"synthetic: the state has no {key!r}; keys are {sorted(state)}")
            noise = rng.standard_normal(size, dtype=self._work)
            noise *= sign * scale
            noise += np.asarray(state[key]).reshape(-1)
            out[key] = noise.astype(self.dtype, copy=False)
        return out

    def _shard_scale(self, x: np.ndarray) -> float:
        # Clients' shards differ, so do their contributions' magnitudes.
        return self.options.noise * (1.0 + float(np.mean(x)) * 10.0) if len(x) else 0.0

    def fit(self, state: Mapping[str, Any], x: np.ndarray, y: np.ndarray, *,
            seed: int) -> FitResult:
        """The state plus noise seeded by ``seed`` and scaled by the shard.

        With ``noise = 0`` the fit is free: it returns the state it was given, its own
        arrays (no noise drawn, nothing copied; the same values the perturbation would
        give), so a round costs what the mesh does with the model and nothing else
        (``benchmarks/large_model.py --noise 0``)."""
        scale = self._shard_scale(x)
        if self.options.noise == 0.0:
            return FitResult(self._given(state), examples=len(x), metrics={"train_loss": 0.0})
        return FitResult(self._perturbed(state, seed, scale), examples=len(x),
                         metrics={"train_loss": scale})

    def _given(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The state's own arrays, flat and in the model's dtype, for a free fit."""
        out = {}
        for i in range(len(self.sizes)):
            key = f"w{i}"
            if key not in state:
                raise KeyError(f"synthetic: the state has no {key!r}; keys are {sorted(state)}")
            out[key] = np.asarray(state[key]).reshape(-1).astype(self.dtype, copy=False)
        return out

    def gradients(self, state: Mapping[str, Any], x: np.ndarray, y: np.ndarray) -> FitResult:
        """Noise seeded by the rows given (so the same batch gives the same gradient)."""
        seed = int(np.asarray(y, dtype=np.int64).sum()) * 1_000_003 + len(y)
        zero = {f"w{i}": np.zeros(size, dtype=self.dtype) for i, size in enumerate(self.sizes)}
        scale = self._shard_scale(x)
        return FitResult(self._perturbed(zero, seed, scale), examples=len(y),
                         metrics={"train_loss": scale})

    def apply(self, state: Mapping[str, Any], gradients: Mapping[str, Any]) -> dict[str, Any]:
        """One step: ``w - lr * g``."""
        out = {}
        for key, value in state.items():
            w: np.ndarray = np.array(value, dtype=self._work)
            g: np.ndarray = np.asarray(gradients[key], dtype=self._work)
            w -= self.options.lr * g
            out[key] = w.astype(self.dtype, copy=False)
        return out

    def evaluate(self, state: Mapping[str, Any]) -> dict[str, float]:
        """The model's mean value (no held-out data: there is nothing to predict)."""
        total = 0.0
        for i, size in enumerate(self.sizes):
            total += float(np.sum(np.asarray(state[f"w{i}"]), dtype=np.float64))
        return {"mean": total / self.options.params}
