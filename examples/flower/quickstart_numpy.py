"""quickstart-numpy: a Flower client in the style of Flower's quickstarts — Flower code only.

A softmax-regression NumPyClient on the 8x8 digits (shipped with meshkit, so
nothing is downloaded). Each client loads its own partition from
``context.node_config`` and reads its hyperparameters from
``context.run_config``, exactly as a Flower ``client_fn`` does; it imports
nothing from meshkit's API. Run it

* under meshkit:  ``meshkit run examples/flower/meshkit.toml`` (from the repository root);
* under Flower's own server loop, for comparison:
  ``python -m examples.flower.flower_server examples.flower.quickstart_numpy:client_fn``.

Training is full-batch gradient descent and the initial model comes from a
fixed seed, so the client is deterministic: the same partitions and rounds
give the same model under either runner.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Context
from flwr.client import ClientApp, NumPyClient

from meshkit_tasks.digits import load_digits  # the data only: 1,797 images shipped with meshkit

CLASSES = 10


def load_data(partition_id: int, num_partitions: int):
    """This partition's (train, test) split: a seeded shuffle cut into equal parts, 80/20."""
    x, y = load_digits()
    order = np.random.default_rng(42).permutation(len(y))
    part = np.array_split(order, num_partitions)[partition_id]
    cut = int(len(part) * 0.8)
    train, test = np.sort(part[:cut]), np.sort(part[cut:])
    return (x[train] / 16.0, y[train]), (x[test] / 16.0, y[test])


def initial_parameters() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.normal(0.0, 0.01, size=(64, CLASSES)), np.zeros(CLASSES)]


def _forward(w: np.ndarray, b: np.ndarray, x: np.ndarray) -> np.ndarray:
    logits = x @ w + b
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    return p / p.sum(axis=1, keepdims=True)


def _loss(p: np.ndarray, y: np.ndarray) -> float:
    return float(-np.log(np.maximum(p[np.arange(len(y)), y], 1e-12)).mean())


class FlowerClient(NumPyClient):
    def __init__(self, train, test, local_epochs: int, lr: float) -> None:
        self.train, self.test = train, test
        self.local_epochs, self.lr = local_epochs, lr

    def get_parameters(self, config):
        return initial_parameters()

    def fit(self, parameters, config):
        w, b = (np.array(p, dtype=np.float64) for p in parameters)
        x, y = self.train
        for _ in range(self.local_epochs):
            p = _forward(w, b, x)
            p[np.arange(len(y)), y] -= 1.0
            p /= len(y)
            w -= self.lr * (x.T @ p)
            b -= self.lr * p.sum(axis=0)
        return [w, b], len(y), {"train_loss": _loss(_forward(w, b, x), y)}

    def evaluate(self, parameters, config):
        w, b = parameters
        x, y = self.test
        p = _forward(w, b, x)
        accuracy = float((p.argmax(axis=1) == y).mean())
        return _loss(p, y), len(y), {"accuracy": accuracy}


def client_fn(context: Context):
    partition_id = int(context.node_config["partition-id"])
    num_partitions = int(context.node_config["num-partitions"])
    train, test = load_data(partition_id, num_partitions)
    return FlowerClient(train, test, int(context.run_config["local-epochs"]),
                        float(context.run_config["learning-rate"])).to_client()


app = ClientApp(client_fn=client_fn)
