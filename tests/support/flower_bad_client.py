"""Flower ``client_fn``s whose partition 2 is deterministically broken: a wrong shape
(``client_fn``) or a fit that hangs (``hanging_client_fn``).

Flower code only (as a user's would be): partitions other than 2 are the
numpy quickstart's client; partition 2's ``fit`` returns its weight matrix
with one row too many, on whichever worker serves it.
"""

from __future__ import annotations

import time

import numpy as np
from flwr.app import Context

from examples.flower.quickstart_numpy import FlowerClient, load_data

BROKEN = 2


class Broken(FlowerClient):
    def fit(self, parameters, config):
        (w, b), n, metrics = super().fit(parameters, config)
        return [np.vstack([w, w[:1]]), b], n, metrics


def _client(context: Context, broken: type) -> object:
    """Partition 2 as ``broken``, every other one the numpy quickstart's client."""
    partition_id = int(context.node_config["partition-id"])
    num_partitions = int(context.node_config["num-partitions"])
    train, test = load_data(partition_id, num_partitions)
    cls = broken if partition_id == BROKEN else FlowerClient
    return cls(train, test, int(context.run_config["local-epochs"]),
               float(context.run_config["learning-rate"])).to_client()


def client_fn(context: Context):
    return _client(context, Broken)


class Hanging(FlowerClient):
    def fit(self, parameters, config):
        time.sleep(HANG_SECONDS)  # far past the run's [mesh] timeout: a stall
        return super().fit(parameters, config)


#: How long partition 2's fit hangs under ``hanging_client_fn`` (the worker is stopped first).
HANG_SECONDS = 600


def hanging_client_fn(context: Context):
    """As :func:`client_fn`, but partition 2's ``fit`` hangs instead of misshaping."""
    return _client(context, Hanging)
