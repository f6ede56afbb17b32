"""A Message-API ClientApp under Flower's own ``FedAvg`` (``flwr.serverapp.strategy``), in one process.

Flower's simulation runs its SuperNodes on Ray, which this project does not
install; this drives the app through everything else of Flower's: the
strategy's ``start`` loop (sampling, ``configure_train``/``configure_evaluate``
messages, ``aggregate_arrayrecords`` weighted by ``"num-examples"``,
``aggregate_metricrecords``) over :class:`InProcessGrid`, a ``Grid`` whose
nodes are one ``Context`` per partition and which delivers each message by
calling the app (``app(message, context)``), as a SuperNode does.
``tests/flower/test_flower_message_api.py`` compares it with ``meshkit run``.

    cd examples/flower-message
    PYTHONPATH=../.. python -m examples.flower.flower_grid digitsexample.client_app:app \\
        digitsexample.task:Net --lr 0.1
"""

from __future__ import annotations

import argparse
import importlib
import time
from typing import Any, Callable, Iterable

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity

__all__ = ["InProcessGrid", "run_flower_app"]


class InProcessGrid(Grid):
    """A Grid of one in-process node per partition; a message is delivered by calling the app."""

    def __init__(self, app: ClientApp, contexts: dict[int, Context]) -> None:
        self.app, self.contexts = app, contexts
        self._run: Any = None
        self._replies: dict[str, Message] = {}
        self._ids = 0

    def set_run(self, run: Any) -> None:
        self._run = run

    @property
    def run(self) -> Any:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:
        return Message(content=content, dst_node_id=dst_node_id, message_type=message_type,
                       group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            self._ids += 1
            # As Flower's InMemoryGrid does (flwr/superlink/grid/inmemory_grid.py).
            message.metadata.__dict__["_message_id"] = str(self._ids)
            node = message.metadata.dst_node_id
            self._replies[message.metadata.message_id] = self.app(message, self.contexts[node])
            ids.append(message.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(i) for i in message_ids]

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))


def run_flower_app(app: ClientApp, initial: Callable[[], Any], *, num_partitions: int,
                   rounds: int, run_config: dict, train_config: dict, seed: int = 0) -> dict:
    """``rounds`` of Flower's FedAvg over every partition; the last round's figures and model.

    The initial model is built as meshkit builds it (torch seeded with ``seed``,
    then ``initial()``), so both start from the same arrays.
    """
    contexts = {p + 1: Context(run_id=0, node_id=p + 1,
                               node_config={"partition-id": p, "num-partitions": num_partitions},
                               state=RecordDict(), run_config=dict(run_config))
                for p in range(num_partitions)}
    # What Flower's ServerApp runtime sets before the ServerApp runs
    # (flwr/server/compat/app.py): the run, this task and the SuperLink's node.
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 0, 0
    torch.manual_seed(seed)
    initial_arrays = ArrayRecord(initial().state_dict())
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=1.0,
                      min_train_nodes=num_partitions, min_evaluate_nodes=num_partitions,
                      min_available_nodes=num_partitions)
    started = time.perf_counter()
    result = strategy.start(grid=InProcessGrid(app, contexts), initial_arrays=initial_arrays,
                            num_rounds=rounds, train_config=ConfigRecord(dict(train_config)))
    seconds = time.perf_counter() - started
    return {"evaluate": dict(result.evaluate_metrics_clientapp[rounds]),
            "train": dict(result.train_metrics_clientapp[rounds]),
            "arrays": {k: v.numpy() for k, v in result.arrays.items()},
            "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("app", help="module:attribute of the ClientApp")
    parser.add_argument("initial", help="module:attribute of the initial model's class")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    def load(reference: str) -> Any:
        module, _, attribute = reference.partition(":")
        return getattr(importlib.import_module(module), attribute)

    result = run_flower_app(load(args.app), load(args.initial), num_partitions=args.partitions,
                            rounds=args.rounds,
                            run_config={"local-epochs": args.local_epochs,
                                        "batch-size": args.batch_size},
                            train_config={"lr": args.lr})
    print(f"flower: {result['evaluate']} in {result['seconds']:.2f} s")


if __name__ == "__main__":
    main()
