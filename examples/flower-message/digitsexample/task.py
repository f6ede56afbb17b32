"""digitsexample: a Flower / PyTorch app.

Flower's quickstart-pytorch ``task.py`` with only the data loader changed:
``load_data`` reads the 8x8 digits shipped with meshkit (nothing can be
downloaded here) instead of CIFAR-10 through ``flwr_datasets``, and yields
the same ``{"img", "label"}`` batches; ``Net`` is the quickstart's small CNN
sized for 1x8x8 images. ``train`` and ``test`` are the quickstart's.
"""

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from meshkit_tasks.digits import load_digits  # the data only (1,797 images, shipped)


class Net(nn.Module):
    """Model (a small CNN in the quickstart's shape, for 1x8x8 digits)"""

    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 6, 3)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(6 * 3 * 3, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = x.view(-1, 6 * 3 * 3)
        x = F.relu(self.fc1(x))
        return self.fc2(x)


class _Digits(Dataset):
    """The quickstart's batches: {"img": float tensor [1, 8, 8], "label": int}."""

    def __init__(self, x, y):
        self.x = torch.tensor(x.reshape(-1, 1, 8, 8) / 16.0, dtype=torch.float32)
        self.y = torch.tensor(y)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"img": self.x[i], "label": self.y[i]}


def load_data(partition_id: int, num_partitions: int, batch_size: int):
    """Load partition digits data (the line a Flower user changes: the data loader)."""
    x, y = load_digits()
    # IID partitions (IidPartitioner), then 80% train, 20% test (seed 42)
    part = np.array_split(np.random.default_rng(42).permutation(len(y)), num_partitions)
    rows = part[partition_id]
    cut = int(len(rows) * 0.8)
    train, test = np.sort(rows[:cut]), np.sort(rows[cut:])
    # A seeded shuffle, so every runner sees the same batches.
    shuffle = torch.Generator().manual_seed(partition_id)
    trainloader = DataLoader(_Digits(x[train], y[train]), batch_size=batch_size, shuffle=True,
                             generator=shuffle)
    testloader = DataLoader(_Digits(x[test], y[test]), batch_size=batch_size)
    return trainloader, testloader


def train(net, trainloader, epochs, lr, device):
    """Train the model on the training set."""
    net.to(device)  # move model to GPU if available
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for batch in trainloader:
            images = batch["img"].to(device)
            labels = batch["label"].to(device)
            optimizer.zero_grad()
            loss = criterion(net(images), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    avg_trainloss = running_loss / (epochs * len(trainloader))
    return avg_trainloss


def test(net, testloader, device):
    """Validate the model on the test set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for batch in testloader:
            images = batch["img"].to(device)
            labels = batch["label"].to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (torch.max(outputs.data, 1)[1] == labels).sum().item()
    accuracy = correct / len(testloader.dataset)
    loss = loss / len(testloader)
    return loss, accuracy
