"""A small BatchNorm CNN on meshkit's shipped 8x8 digits, as a meshkit task.

    meshkit run examples/torch/federated.toml       # FedAvg over 6 clients
    meshkit run examples/torch/data-parallel.toml   # synchronous SGD, DDP-style

Everything after the model definition is what a user writes: the data and
one ``meshkit.torch.task(...)`` call. docs/torch.md sets it beside Flower's
quickstart-pytorch.
"""

import numpy as np
import torch
from torch import nn

import meshkit.torch
from meshkit_tasks.digits import DigitsOptions, DigitsTask


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(32 * 2 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def digits(options):
    """Images [n, 1, 8, 8] in 0..1 and labels: the digits task's fixed 80/20 split, or
    a node's own train.csv/test.csv in directory ``options.data`` (--task-option data=DIR)."""
    own = options.data and {"train_csv": f"{options.data}/train.csv",
                            "test_csv": f"{options.data}/test.csv"}
    split = DigitsTask(DigitsOptions(**own) if own else None)

    def images(x, y):
        return np.asarray(x, np.float32).reshape(-1, 1, 8, 8) / 16, np.asarray(y)

    return images(*split.train_data()), images(*split.test_data())


task = meshkit.torch.task(
    model=Net, loss=nn.CrossEntropyLoss(), data=digits,
    optimizer=lambda params, options: torch.optim.SGD(params, lr=options.lr, momentum=0.9))
