"""The ``synthetic-federated`` task: LEAF's / FedProx's synthetic(alpha, beta), a client at a time.

Li et al., *Federated Optimization in Heterogeneous Networks* (FedProx,
MLSys 2020), section 5.1, as LEAF's ``data/synthetic`` generates it
(Caldas et al., *LEAF: A Benchmark for Federated Settings*, 2018). Client k
has its own model and its own feature distribution::

    u_k ~ N(0, alpha^2)      W_k ~ N(u_k, 1)^(dim x classes)   b_k ~ N(u_k, 1)^classes
    B_k ~ N(0, beta^2)       v_k ~ N(B_k, 1)^dim
    x ~ N(v_k, Sigma)        Sigma diagonal, Sigma_jj = j^-1.2 (j = 1..dim)
    y = argmax softmax(W_k^T x + b_k)

alpha controls how much the clients' models differ, beta how much their
features do; synthetic(0, 0) is the paper's least heterogeneous setting,
synthetic(1, 1) its most. (The paper writes N(0, alpha); its and LEAF's
code draw with standard deviation alpha, as here.) Client k's example count
is LEAF's: ``min(min_samples + floor(lognormal(3, 2)), max_samples)``
(5 and 1,000 by default; a median of 25, a long tail). Its last
``test_fraction`` of rows (10 %, rounded, at least one row kept for
training) are its held-out data.

Everything about client k is drawn from its own stream, seeded by
``(data_seed, k)``: making client 99,999 costs what making client 0 does,
and needs no other client. So the population can be any size, and a node
holds one client's rows only while it trains or evaluates them
(:mod:`meshkit.population`).

The model is a small numpy MLP (``dim -> hidden -> classes``, ReLU,
softmax cross-entropy, minibatch SGD); ``hidden = 0`` is FedProx's
multinomial logistic regression. Its state is float32.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from meshkit import ConfigError
from meshkit.task import FitResult
from meshkit_tasks.options import SyntheticFederatedOptions

__all__ = ["SyntheticFederatedOptions", "SyntheticFederatedTask"]

#: Names this task's stream among the data seed's (so another draw never shares it).
_STREAM = 0x5E7F
_DTYPE = np.dtype(np.float32)


#: The most elements one array of this task may hold (8 GiB of float32). The task
#: holds each whole in memory -- a client's features (max_samples x dim), its
#: true model (dim x classes, float64), each layer of the MLP -- so a size past
#: this is refused at start-up, naming the keys, rather than failing to
#: allocate (or overflowing numpy's size) on a worker mid-run.
MAX_ARRAY_ELEMENTS = 2 ** 31


def _refuse_oversized(opts: SyntheticFederatedOptions) -> None:
    arrays = [(("max_samples", "dim"), "a client's features", opts.max_samples * opts.dim),
              (("dim", "classes"), "a client's true model", opts.dim * opts.classes)]
    if opts.hidden:
        arrays += [(("dim", "hidden"), "the first layer", opts.dim * opts.hidden),
                   (("hidden", "classes"), "the second layer", opts.hidden * opts.classes)]
    for keys, what, elements in arrays:
        if elements > MAX_ARRAY_ELEMENTS:
            a, b = keys
            raise ConfigError(
                f"[task] {a} = {getattr(opts, a)}, {b} = {getattr(opts, b)}: {what} would "
                f"hold {elements:,} elements, more than the {MAX_ARRAY_ELEMENTS:,} one array "
                f"of synthetic-federated may hold (it keeps each whole in memory); lower "
                f"{a} or {b}")


class SyntheticFederatedTask:
    """synthetic(alpha, beta) over ``clients`` clients (a :class:`meshkit.population.Population`)."""

    Options = SyntheticFederatedOptions

    def __init__(self, options: SyntheticFederatedOptions | None = None) -> None:
        self.options = opts = options or SyntheticFederatedOptions()
        if opts.min_samples > opts.max_samples:
            raise ConfigError(f"[task] min_samples = {opts.min_samples} is more than "
                              f"max_samples = {opts.max_samples}")
        if opts.classes < 2:
            raise ConfigError(f"[task] classes = {opts.classes}: a classifier needs at least 2")
        _refuse_oversized(opts)
        # x's standard deviations: sqrt(Sigma_jj) = j^-0.6
        self._scale = np.power(np.arange(1, opts.dim + 1, dtype=np.float64), -0.6).astype(_DTYPE)
        self._pooled: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    # -- the population ------------------------------------------------------------

    def population(self) -> int:
        return self.options.clients

    def examples(self, client: int) -> int:
        """Client ``client``'s example count (training and held-out), LEAF's draw."""
        return len(self._client(client)[1])

    def _client(self, client: int) -> tuple[np.ndarray, np.ndarray]:
        """All of client ``client``'s rows, a pure function of (data_seed, client)."""
        opts = self.options
        if not 0 <= client < opts.clients:
            raise ConfigError(f"client {client} requested, but [task] clients = "
                              f"{opts.clients} (clients 0..{opts.clients - 1})")
        rng = np.random.default_rng([int(opts.data_seed) & 0xFFFFFFFF, _STREAM, int(client)])
        u = rng.normal(0.0, opts.alpha)
        w = rng.normal(u, 1.0, (opts.dim, opts.classes))
        b = rng.normal(u, 1.0, opts.classes)
        v = rng.normal(rng.normal(0.0, opts.beta), 1.0, opts.dim)
        n = min(opts.min_samples + int(rng.lognormal(3.0, 2.0)), opts.max_samples)
        x = rng.standard_normal((n, opts.dim), dtype=_DTYPE)
        x *= self._scale
        x += v.astype(_DTYPE)
        # argmax of the softmax is the argmax of the logits
        y = np.argmax(x @ w.astype(_DTYPE) + b.astype(_DTYPE), axis=1).astype(np.int64)
        return x, y

    def _cut(self, n: int) -> int:
        """Training rows of a client with ``n``: the first ones, at least one."""
        return max(1, n - int(round(n * self.options.test_fraction)))

    def client_data(self, client: int) -> tuple[np.ndarray, np.ndarray]:
        """Client ``client``'s training rows (made now, kept by no one)."""
        x, y = self._client(client)
        cut = self._cut(len(y))
        return x[:cut], y[:cut]

    def client_test_data(self, client: int) -> tuple[np.ndarray, np.ndarray]:
        """Client ``client``'s held-out rows (may be none for a tiny client)."""
        x, y = self._client(client)
        cut = self._cut(len(y))
        return x[cut:], y[cut:]

    def _pool(self, which: str) -> tuple[np.ndarray, np.ndarray]:
        if which not in self._pooled:
            count = min(self.options.eval_clients, self.options.clients)
            make = self.client_data if which == "train" else self.client_test_data
            parts = [make(c) for c in range(count)]
            x = np.concatenate([p[0] for p in parts])
            y = np.concatenate([p[1] for p in parts])
            x.setflags(write=False)
            y.setflags(write=False)
            self._pooled[which] = (x, y)
        return self._pooled[which]

    def train_data(self) -> tuple[np.ndarray, np.ndarray]:
        """Clients 0..eval_clients-1's training rows pooled (what ``local``/data-parallel use)."""
        return self._pool("train")

    def test_data(self) -> tuple[np.ndarray, np.ndarray]:
        """Clients 0..eval_clients-1's held-out rows pooled (the coordinator's evaluation)."""
        return self._pool("test")

    # -- the model -----------------------------------------------------------------

    def _layers(self) -> list[tuple[str, str, int, int]]:
        opts = self.options
        if opts.hidden == 0:
            return [("w", "b", opts.dim, opts.classes)]
        return [("w1", "b1", opts.dim, opts.hidden), ("w2", "b2", opts.hidden, opts.classes)]

    def init_state(self, seed: int) -> dict[str, Any]:
        """Glorot-uniform weights and zero biases, a pure function of ``seed``."""
        rng = np.random.default_rng(seed)
        state: dict[str, Any] = {}
        for w, b, fan_in, fan_out in self._layers():
            limit = math.sqrt(6.0 / (fan_in + fan_out))
            state[w] = rng.uniform(-limit, limit, (fan_in, fan_out)).astype(_DTYPE)
            state[b] = np.zeros(fan_out, _DTYPE)
        return state

    def _params(self, state: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """A float32 working copy of the model's arrays (the input is never changed)."""
        params = {}
        for w, b, fan_in, fan_out in self._layers():
            for key, shape in ((w, (fan_in, fan_out)), (b, (fan_out,))):
                if key not in state:
                    raise KeyError(f"synthetic-federated: the state has no {key!r}; its keys "
                                   f"are {sorted(state)}")
                value = np.array(state[key], dtype=_DTYPE)
                if value.shape != shape:
                    raise ValueError(f"synthetic-federated: {key!r} is {list(value.shape)}, "
                                     f"the model needs {list(shape)}")
                params[key] = value
        return params

    def _logits(self, p: Mapping[str, np.ndarray], x: np.ndarray) -> list[np.ndarray]:
        """Each layer's output (pre-activation), input first."""
        outs = [x]
        layers = self._layers()
        for i, (w, b, _, _) in enumerate(layers):
            h = outs[-1] @ p[w]
            h += p[b]
            if i < len(layers) - 1:
                np.maximum(h, 0.0, out=h)
            outs.append(h)
        return outs

    def _loss_and_grads(self, p: Mapping[str, np.ndarray], x: np.ndarray,
                        y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
        outs = self._logits(p, x)
        z = outs[-1]
        z -= z.max(axis=1, keepdims=True)
        np.exp(z, out=z)
        z /= z.sum(axis=1, keepdims=True)
        rows = np.arange(len(y))
        loss = -float(np.mean(np.log(np.maximum(z[rows, y], 1e-12))))
        z[rows, y] -= 1.0
        z /= len(y)
        grads: dict[str, np.ndarray] = {}
        delta = z
        layers = self._layers()
        for i in range(len(layers) - 1, -1, -1):
            w, b, _, _ = layers[i]
            grads[w] = outs[i].T @ delta
            grads[b] = delta.sum(axis=0)
            if i:
                delta = delta @ p[w].T
                delta *= outs[i] > 0
        return loss, grads

    def fit(self, state: Mapping[str, Any], x: np.ndarray, y: np.ndarray, *,
            seed: int) -> FitResult:
        """Minibatch SGD over the client's rows for ``epochs`` passes, from ``state``."""
        opts = self.options
        p = self._params(state)
        x = np.asarray(x, dtype=_DTYPE)
        y = np.asarray(y, dtype=np.int64)
        rng = np.random.default_rng(seed)
        n = len(y)
        total = 0.0
        for _ in range(opts.epochs):
            order = rng.permutation(n)
            total = 0.0
            for start in range(0, n, opts.batch_size):
                batch = order[start:start + opts.batch_size]
                loss, grads = self._loss_and_grads(p, x[batch], y[batch])
                total += loss * len(batch)
                for key, g in grads.items():
                    g *= opts.lr
                    p[key] -= g
        return FitResult(p, examples=n * opts.epochs,
                         metrics={"train_loss": total / max(n, 1)})

    def evaluate(self, state: Mapping[str, Any], x: np.ndarray | None = None,
                 y: np.ndarray | None = None) -> dict[str, float]:
        """Loss and accuracy on ``(x, y)``, or on the pooled held-out rows (:meth:`test_data`)."""
        if x is None or y is None:
            x, y = self.test_data()
        if len(y) == 0:
            raise ConfigError("synthetic-federated: no held-out rows to evaluate on; raise "
                              "[task] eval_clients or test_fraction")
        p = self._params(state)
        z = self._logits(p, np.asarray(x, dtype=_DTYPE))[-1].astype(np.float64)
        z -= z.max(axis=1, keepdims=True)
        log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        y = np.asarray(y, dtype=np.int64)
        return {"loss": float(-np.mean(log_p[np.arange(len(y)), y])),
                "accuracy": float(np.mean(np.argmax(z, axis=1) == y))}
