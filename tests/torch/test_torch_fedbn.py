"""FedBN on the Dirichlet split: examples/torch's BatchNorm CNN with ``local_keys = ["@norm"]``
settles where plain FedAvg still swings, at an accuracy at least FedAvg's."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="meshkit.torch needs PyTorch (the torch extra)")

import meshkit.plugins  # noqa: E402
import meshkit.torch as mt  # noqa: E402
from meshkit.train import LocalPool, StrategyContext, Trainer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from examples.torch.digits_cnn import Net, digits  # noqa: E402

pytestmark = pytest.mark.slow

ROWS, ROUNDS, CLIENTS, ALPHA, LAST = 800, 10, 4, 0.1, 3


def cnn():
    def data(options):
        (x, y), test = digits(options)
        return (x[:ROWS], y[:ROWS]), test

    component = mt.task(model=Net, loss=torch.nn.CrossEntropyLoss(), data=data,
                        optimizer=lambda p, o: torch.optim.SGD(p, lr=o.lr, momentum=0.9))
    return component.build(mt.TorchOptions(lr=0.05, epochs=2, threads=1, device="cpu"))


def client_accuracy(local_keys: list[str]) -> list[float]:
    """Each round's example-weighted client accuracy (every client on its own held-out share)."""
    split = meshkit.plugins.create("partitioner", "dirichlet", {"alpha": ALPHA})
    trainers = {r: Trainer(cnn(), partitioner=split, partitioner_name="dirichlet", seed=0)
                for r in (1, 2)}
    reports = []
    ctx = StrategyContext(
        task=cnn(), aggregator=meshkit.plugins.create("aggregator", "fedavg"),
        pool=LocalPool(trainers), workers=[1, 2], rng=np.random.default_rng(0), seed=0,
        outer=meshkit.plugins.create("outer_optimizer", "average"), partitioner=split,
        on_round=lambda report, state: reports.append(report))
    meshkit.plugins.create("strategy", "federated", {
        "rounds": ROUNDS, "clients": CLIENTS, "evaluate": "clients",
        "local_keys": local_keys}).run(ctx)
    return [r.metrics["client_accuracy"] for r in reports]


def test_fedbn_settles_where_fedavg_swings_and_is_at_least_as_accurate():
    fedavg, fedbn = client_accuracy([]), client_accuracy(["@norm"])
    spread = {name: max(acc[-LAST:]) - min(acc[-LAST:])
              for name, acc in (("fedavg", fedavg), ("fedbn", fedbn))}
    assert spread["fedbn"] <= 0.02, (fedbn, spread)
    assert spread["fedbn"] < spread["fedavg"], (fedavg, fedbn)
    assert np.mean(fedbn[-LAST:]) >= np.mean(fedavg[-LAST:]), (fedavg, fedbn)
