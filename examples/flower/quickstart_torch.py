"""quickstart-pytorch: a Flower NumPyClient around a torch model, in Flower's quickstart style.

Flower code only (no meshkit API): a small MLP on the 8x8 digits (the data
shipped with meshkit), its partition from ``context.node_config``, its
hyperparameters from ``context.run_config``. Full-batch SGD from a fixed
initial seed, so it is deterministic under any runner.

    meshkit run examples/flower/meshkit-torch.toml     (from the repository root)
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
from flwr.app import Context
from flwr.client import ClientApp, NumPyClient
from torch import nn

from examples.flower.quickstart_numpy import load_data


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def new_net() -> Net:
    torch.manual_seed(0)  # the same initial model on every client and every runner
    return Net()


def get_weights(net: Net) -> list[np.ndarray]:
    return [v.detach().cpu().numpy().copy() for v in net.state_dict().values()]


def set_weights(net: Net, parameters: list[np.ndarray]) -> None:
    keys = net.state_dict().keys()
    net.load_state_dict(OrderedDict((k, torch.tensor(np.asarray(v))) for k, v in
                                    zip(keys, parameters)), strict=True)


class FlowerClient(NumPyClient):
    def __init__(self, train, test, local_epochs: int, lr: float) -> None:
        self.net = new_net()
        self.train = tuple(torch.tensor(a) for a in (train[0].astype(np.float32), train[1]))
        self.test = tuple(torch.tensor(a) for a in (test[0].astype(np.float32), test[1]))
        self.local_epochs, self.lr = local_epochs, lr

    def get_parameters(self, config):
        return get_weights(self.net)

    def fit(self, parameters, config):
        set_weights(self.net, parameters)
        optimizer = torch.optim.SGD(self.net.parameters(), lr=self.lr)
        x, y = self.train
        for _ in range(self.local_epochs):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(self.net(x), y)
            loss.backward()
            optimizer.step()
        return get_weights(self.net), len(y), {"train_loss": float(loss.detach())}

    def evaluate(self, parameters, config):
        set_weights(self.net, parameters)
        x, y = self.test
        with torch.no_grad():
            logits = self.net(x)
            loss = float(nn.functional.cross_entropy(logits, y))
            accuracy = float((logits.argmax(dim=1) == y).float().mean())
        return loss, len(y), {"accuracy": accuracy}


def client_fn(context: Context):
    partition_id = int(context.node_config["partition-id"])
    num_partitions = int(context.node_config["num-partitions"])
    train, test = load_data(partition_id, num_partitions)
    return FlowerClient(train, test, int(context.run_config["local-epochs"]),
                        float(context.run_config["learning-rate"])).to_client()


app = ClientApp(client_fn=client_fn)
