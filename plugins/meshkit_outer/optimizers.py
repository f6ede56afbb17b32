"""Outer optimizer implementations (DESIGN section 4; Reddi et al. 2020; DiLoCo).

Every optimizer descends on the pseudo-gradient ``g = global - consensus``.
Float arrays are stepped with moments kept in the parameter's accumulation
dtype (float32 for float16/bfloat16/float32, float64 for float64) and the
result comes back in the global parameter's dtype; integer/bool arrays and
JSON values adopt the consensus. See docs/outer-optimizers.md.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import attrs
import numpy as np

from meshkit.outer import join_buffers, pseudo_gradient, split_buffers, stepped_keys
from meshkit.state import State, StateError, accumulate_dtype, dtype_name

__all__ = ["Average", "Nesterov", "FedAvgM", "FedAdagrad", "FedAdam", "FedYogi"]

log = logging.getLogger(__name__)


class Average:
    """Adopts the consensus: ``x <- consensus``. Stateless; the plain FedAvg path."""

    name = "average"

    def step(self, global_state: State | None, consensus: State) -> dict[str, Any]:
        if global_state is not None:
            # Same keys and shapes, or the global model would silently lose a key.
            stepped_keys(global_state, consensus, name=self.name)
        # Byte for byte: the consensus arrays themselves, not a recomputation.
        return dict(consensus)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.name}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        extra = sorted(k for k in state if k != "optimizer")
        if state.get("optimizer", self.name) != self.name or extra:
            raise StateError(
                f"outer optimizer average keeps no state, but was given "
                f"{_describe_state(state)}; was the checkpoint written by another optimizer?")


def _describe_state(state: Mapping[str, Any]) -> str:
    name = state.get("optimizer")
    keys = sorted(k for k in state if k != "optimizer")
    shown = ", ".join(map(repr, keys[:5])) + (", ..." if len(keys) > 5 else "")
    return f"state of {name!r} with keys [{shown}]" if name else f"keys [{shown}]"


def _array(value: Any) -> np.ndarray:
    """A ufunc's result as an array: on a 0-d input numpy returns a scalar, which
    cannot be the ``out=`` of the next step (a 0-d parameter is a parameter too)."""
    return value if isinstance(value, np.ndarray) else np.asarray(value)


class _Stateful:
    """Shared round bookkeeping: validation, lazy buffers, checkpointing."""

    name = "outer"
    #: Moment buffers, by prefix in the state dict ("b", "m", "v").
    buffers: tuple[str, ...] = ()

    def __init__(self, options: Any) -> None:
        self.options = options
        self.t = 0  # rounds stepped so far
        self._buf: dict[str, dict[str, np.ndarray]] = {b: {} for b in self.buffers}

    # -- the contract ---------------------------------------------------------

    def step(self, global_state: State, consensus: State) -> dict[str, Any]:
        keys = stepped_keys(global_state, consensus, name=self.name)
        self._check_buffers(global_state, keys)
        if not self._buf[self.buffers[0]]:
            if keys and self.t > 0:
                # Checked here, not at load: a model without float arrays
                # (a filter's {"mu": 1.5}) rightly checkpoints no moments.
                raise StateError(
                    f"outer optimizer {self.name}: it is at round {self.t} but holds no moment "
                    f"buffers for {', '.join(map(repr, keys[:5]))}"
                    f"{', ...' if len(keys) > 5 else ''} (a checkpoint without moments, or a "
                    f"model that gained float parameters); resume from a checkpoint written "
                    f"for this model")
            for key in keys:
                dtype = accumulate_dtype(global_state[key].dtype)
                for b in self.buffers:
                    self._buf[b][key] = self._initial(b, np.shape(global_state[key]), dtype)
        self.t += 1
        out: dict[str, Any] = {}
        stepped = set(keys)
        for key, x in global_state.items():
            if key not in stepped:
                out[key] = consensus[key]  # integer/bool arrays and JSON adopt the consensus
                continue
            x = np.asarray(x)
            dtype = accumulate_dtype(x.dtype)
            g = pseudo_gradient(x, consensus[key], dtype)
            new = x.astype(dtype, copy=True)
            self._update(key, new, g)
            out[key] = new.astype(x.dtype, copy=False)
        return out

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "optimizer": self.name,
            "t": self.t,
            "options": attrs.asdict(self.options),
        }
        state.update(join_buffers(self._buf))
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        found = state.get("optimizer")
        if found != self.name:
            raise StateError(
                f"outer optimizer {self.name}: the checkpoint holds the state of "
                f"{found!r}, not {self.name!r}; resume with the optimizer that wrote it")
        t = state.get("t")
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise StateError(f"outer optimizer {self.name}: 't' must be a round count >= 0, "
                             f"found {t!r}")
        buffers = split_buffers(state, self.buffers, name=self.name)
        keys = [set(table) for table in buffers.values()]
        if any(k != keys[0] for k in keys):
            raise StateError(f"outer optimizer {self.name}: the moment buffers "
                             f"{', '.join(self.buffers)} do not cover the same parameters")
        unknown = sorted(k for k in state if k not in ("optimizer", "t", "options")
                         and k.partition("/")[0] not in self.buffers)
        if unknown:
            raise StateError(f"outer optimizer {self.name}: unknown state entries "
                             f"{', '.join(map(repr, unknown))}")
        saved = state.get("options")
        if isinstance(saved, Mapping) and saved != attrs.asdict(self.options):
            # Changing hyperparameters on resume can be deliberate; say so, don't refuse.
            log.warning("outer optimizer %s: resuming with options %s, the checkpoint was "
                        "written with %s", self.name, attrs.asdict(self.options), dict(saved))
        self.t = t
        self._buf = buffers

    # -- helpers ----------------------------------------------------------------

    def _check_buffers(self, global_state: State, keys: list[str]) -> None:
        table = self._buf[self.buffers[0]]
        if not table:
            return
        if set(table) != set(keys):
            missing = sorted(set(keys) - set(table))
            gone = sorted(set(table) - set(keys))
            raise StateError(
                f"outer optimizer {self.name}: the global model's float parameters changed "
                f"between rounds (new: {missing or 'none'}, gone: {gone or 'none'}); an "
                f"optimizer's moments belong to one model")
        for key in keys:
            x = global_state[key]
            buf = table[key]
            if buf.shape != np.shape(x):
                raise StateError(
                    f"outer optimizer {self.name}: {key!r} has shape {np.shape(x)} but its "
                    f"moments have {buf.shape}; the model changed between rounds")
            if buf.dtype != accumulate_dtype(x.dtype):
                raise StateError(
                    f"outer optimizer {self.name}: {key!r} is {dtype_name(x.dtype)}, whose "
                    f"moments are kept in {dtype_name(accumulate_dtype(x.dtype))}, but they "
                    f"are {dtype_name(buf.dtype)}; the model's dtype changed between rounds")

    def _initial(self, buffer: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        return np.zeros(shape, dtype=dtype)

    def _update(self, key: str, x: np.ndarray, g: np.ndarray) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.options!r}, t={self.t})"


class Nesterov(_Stateful):
    """DiLoCo's outer Nesterov: ``b <- mu b + g; x <- x - lr (g + mu b)``."""

    name = "nesterov"
    buffers = ("b",)

    def _update(self, key: str, x: np.ndarray, g: np.ndarray) -> None:
        mu, lr = self.options.momentum, self.options.lr
        b = self._buf["b"][key]
        np.multiply(b, mu, out=b)
        np.add(b, g, out=b)
        direction = _array(np.multiply(b, mu))
        np.add(direction, g, out=direction)
        np.multiply(direction, lr, out=direction)
        np.subtract(x, direction, out=x)


class FedAvgM(_Stateful):
    """Server momentum: ``b <- mu b + g; x <- x - lr b``."""

    name = "fedavgm"
    buffers = ("b",)

    def _update(self, key: str, x: np.ndarray, g: np.ndarray) -> None:
        mu, lr = self.options.momentum, self.options.lr
        b = self._buf["b"][key]
        np.multiply(b, mu, out=b)
        np.add(b, g, out=b)
        np.subtract(x, np.multiply(b, lr), out=x)


class _Adaptive(_Stateful):
    """FedOpt: ``m <- b1 m + (1-b1) g``, a second moment ``v``, ``x <- x - lr m/(sqrt v + tau)``."""

    buffers = ("m", "v")

    def _initial(self, buffer: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        # Reddi et al. start v at tau^2 (v_{-1} >= tau^2), m at zero.
        if buffer == "v":
            return np.full(shape, self.options.tau ** 2, dtype=dtype)
        return np.zeros(shape, dtype=dtype)

    def _second_moment(self, v: np.ndarray, g2: np.ndarray) -> None:
        raise NotImplementedError

    def _update(self, key: str, x: np.ndarray, g: np.ndarray) -> None:
        o = self.options
        m, v = self._buf["m"][key], self._buf["v"][key]
        np.multiply(m, o.beta1, out=m)
        np.add(m, np.multiply(g, 1.0 - o.beta1), out=m)
        g2 = np.multiply(g, g)
        self._second_moment(v, g2)
        m_hat, v_hat = self._corrected(m, v)
        denominator = _array(np.sqrt(v_hat))
        np.add(denominator, o.tau, out=denominator)
        direction = _array(np.divide(m_hat, denominator))
        np.multiply(direction, o.lr, out=direction)
        np.subtract(x, direction, out=x)

    def _corrected(self, m: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return m, v


class FedAdagrad(_Adaptive):
    """``v <- v + g^2``."""

    name = "fedadagrad"

    def _second_moment(self, v: np.ndarray, g2: np.ndarray) -> None:
        np.add(v, g2, out=v)


class FedAdam(_Adaptive):
    """``v <- b2 v + (1-b2) g^2``; optional bias correction by ``1 - b^t``.

    With bias correction it is Adam (``torch.optim.Adam`` with ``eps = tau``
    and ``g`` as the gradient): both moments start at zero, which is the
    start the ``1 - b^t`` divisors undo. Starting ``v`` at ``tau^2`` and then
    dividing it by ``1 - b2^t`` would inflate that floor a hundredfold in
    round one (``b2 = 0.99``) and damp the first steps. Without bias
    correction ``v`` starts at ``tau^2`` (Reddi et al.), as for the others.
    """

    name = "fedadam"

    def _initial(self, buffer: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if buffer == "v" and self.options.bias_correction:
            return np.zeros(shape, dtype=dtype)
        return super()._initial(buffer, shape, dtype)

    def _second_moment(self, v: np.ndarray, g2: np.ndarray) -> None:
        np.multiply(v, self.options.beta2, out=v)
        np.add(v, np.multiply(g2, 1.0 - self.options.beta2), out=v)

    def _corrected(self, m: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if not self.options.bias_correction:
            return m, v
        o, t = self.options, self.t
        return np.divide(m, 1.0 - o.beta1 ** t), np.divide(v, 1.0 - o.beta2 ** t)


class FedYogi(_Adaptive):
    """``v <- v - (1-b2) g^2 sign(v - g^2)``: additive, sign-controlled second moment."""

    name = "fedyogi"

    def _second_moment(self, v: np.ndarray, g2: np.ndarray) -> None:
        sign = _array(np.sign(np.subtract(v, g2)))
        np.multiply(sign, g2, out=sign)
        np.multiply(sign, 1.0 - self.options.beta2, out=sign)
        np.subtract(v, sign, out=v)
