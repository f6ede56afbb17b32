"""The same Flower client under Flower's own server loop, in one process, for comparison.

Flower's simulation (``flwr.simulation``) needs Ray for its clients; this
drives the client through the rest of Flower instead: ``flwr.server.Server``
(the round loop ``start_simulation`` ran), ``FedAvg`` (sampling, the
``num_examples``-weighted aggregation, ``weighted_loss_avg``) and
``SimpleClientManager``, with one in-process ``ClientProxy`` per partition
that calls ``client_fn(context)`` for every request — what Ray's
``RayActorClientProxy`` does in an actor. Same partitions, same run config,
same seeds as ``meshkit.toml``; ``tests/flower/test_flower_task.py``
compares the two.

    python -m examples.flower.flower_server examples.flower.quickstart_numpy:client_fn
"""

from __future__ import annotations

import argparse
import importlib
import time
from typing import Any, Callable

from flwr.app import Context, RecordDict
from flwr.client import NumPyClient
from flwr.common import parameters_to_ndarrays
from flwr.server import Server, SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import FedAvg

__all__ = ["InProcessClientProxy", "run_flower"]


class InProcessClientProxy(ClientProxy):
    """A ClientProxy that builds the client with ``client_fn`` for each request."""

    def __init__(self, client_fn: Callable[[Context], Any], context: Context) -> None:
        super().__init__(cid=str(context.node_id))
        self.client_fn, self.context = client_fn, context

    def _client(self) -> Any:
        client = self.client_fn(self.context)
        return client.to_client() if isinstance(client, NumPyClient) else client

    def get_properties(self, ins, timeout, group_id):
        return self._client().get_properties(ins)

    def get_parameters(self, ins, timeout, group_id):
        return self._client().get_parameters(ins)

    def fit(self, ins, timeout, group_id):
        return self._client().fit(ins)

    def evaluate(self, ins, timeout, group_id):
        return self._client().evaluate(ins)

    def reconnect(self, ins, timeout, group_id):
        raise NotImplementedError("in-process clients do not reconnect")


def weighted_average(metrics: list[tuple[int, dict]]) -> dict:
    """Flower's quickstart metric aggregation: each metric weighted by num_examples."""
    total = sum(n for n, _ in metrics)
    keys = {k for _, m in metrics for k in m}
    return {k: sum(n * m[k] for n, m in metrics if k in m) / total for k in keys}


def run_flower(client_fn: Callable[[Context], Any], *, num_partitions: int, rounds: int,
               run_config: dict) -> dict:
    """Run ``rounds`` of FedAvg over every partition; the last round's figures and the model."""
    manager = SimpleClientManager()
    for partition in range(num_partitions):
        context = Context(run_id=0, node_id=partition + 1,
                          node_config={"partition-id": partition,
                                       "num-partitions": num_partitions},
                          state=RecordDict(), run_config=dict(run_config))
        manager.register(InProcessClientProxy(client_fn, context))
    strategy = FedAvg(fraction_fit=1.0, fraction_evaluate=1.0, min_fit_clients=num_partitions,
                      min_evaluate_clients=num_partitions,
                      min_available_clients=num_partitions,
                      evaluate_metrics_aggregation_fn=weighted_average)
    server = Server(client_manager=manager, strategy=strategy)
    started = time.perf_counter()
    history, _ = server.fit(num_rounds=rounds, timeout=None)
    seconds = time.perf_counter() - started
    return {
        "loss": history.losses_distributed[-1][1],
        "accuracy": history.metrics_distributed["accuracy"][-1][1],
        "parameters": parameters_to_ndarrays(server.parameters),
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("client_fn", help="module:attribute of the Flower client_fn")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--local-epochs", type=int, default=5)
    parser.add_argument("--learning-rate", type=float, default=0.5)
    args = parser.parse_args()
    module, _, attribute = args.client_fn.partition(":")
    client_fn = getattr(importlib.import_module(module), attribute)
    result = run_flower(client_fn, num_partitions=args.partitions, rounds=args.rounds,
                        run_config={"local-epochs": args.local_epochs,
                                    "learning-rate": args.learning_rate})
    print(f"flower: accuracy {result['accuracy']:.4f} loss {result['loss']:.4f} "
          f"in {result['seconds']:.2f} s")


if __name__ == "__main__":
    main()
