"""A Message-API ``ClientApp`` (``@app.train()``, ``@app.evaluate()``), called as Flower calls it.

Each meshkit fit and evaluation is one message through the app itself
(``app(message, context)``, Flower's public way to run a ``ClientApp``), its
content exactly what Flower's ``FedAvg`` (``flwr.serverapp.strategy``) sends:

===========================  ==================================================
meshkit                      the message
===========================  ==================================================
a fit of client ``c``        ``message_type = "train"``; content
                             ``{"arrays": ArrayRecord, "config": ConfigRecord}``
                             with ``[task.train_config]`` (or ``fit_config``)
the round's evaluation       ``message_type = "evaluate"``, the same content with
                             ``[task.evaluate_config]``
the reply                    one ``ArrayRecord`` (a train reply: the
                             contribution, its keys those sent) and one
                             ``MetricRecord`` holding ``weighted_by_key``
                             (``"num-examples"``): fedavg's weight, as Flower's
                             ``FedAvg`` weighs; every other number in it is a
                             meshkit metric under the same name
===========================  ==================================================

The state's keys are the ``ArrayRecord``'s (a ``state_dict``'s names), in the
initial model's order. Not sent: ``config["server-round"]`` (a meshkit fit is
a function of the model, the client and its seed, not of the round number).
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Mapping, Sequence

import numpy as np
from flwr.app import (DEFAULT_TTL, Array, ArrayRecord, ConfigRecord, Context, Message, Metadata,
                      RecordDict)
from flwr.clientapp import ClientApp

from meshkit.errors import ConfigError, MeshError, RefusedError

__all__ = ["MessageApp", "send", "numbers", "to_record", "to_state"]

log = logging.getLogger(__name__)

_MESSAGE_IDS = itertools.count(1)


def send(app: ClientApp, context: Context, content: RecordDict, message_type: str) -> RecordDict:
    """One message through ``app``, as a SuperNode delivers it; the reply's content.

    A reply carrying an error is a :class:`MeshError` quoting Flower's reason.
    """
    metadata = Metadata(run_id=0, message_id=str(next(_MESSAGE_IDS)), src_node_id=0,
                        dst_node_id=context.node_id, reply_to_message_id="", group_id="",
                        created_at=time.time(), ttl=DEFAULT_TTL, message_type=message_type)
    # metadata=: a message that no SuperLink addressed (this one). (flwr is Any to
    # mypy here: [tool.mypy] skips the optional libraries.)
    reply = app(Message(content=content, metadata=metadata), context)
    if reply.has_error():
        raise MeshError(f"the ClientApp answered {message_type!r} with an error: "
                        f"{reply.error.reason}")
    return reply.content


def numbers(metrics: Mapping[str, Any], where: str, skip: str = "") -> dict[str, float]:
    """The numeric entries of a metrics mapping (a ``MetricRecord``), as floats."""
    out: dict[str, float] = {}
    for key, value in dict(metrics or {}).items():
        if key == skip:
            continue
        if isinstance(value, (bool, int, float, np.number)):
            out[str(key)] = float(value)
        else:
            log.debug("%s: metric %r is a %s, not a number; meshkit records numbers only",
                      where, key, type(value).__name__)
    return out


class MessageApp:
    """A Message-API ``ClientApp`` as meshkit's fits and evaluations (module docstring)."""

    def __init__(self, app: ClientApp, where: str) -> None:
        registered = getattr(app, "_registered_funcs", {})  # no public accessor in flwr
        if not any(name.startswith("train.") for name in registered):
            raise ConfigError(f"{where} is a ClientApp with no @app.train() function and no "
                              f"client_fn: meshkit has nothing to fit with")
        # A function registered with mods (@app.train(mods=[...])) is wrapped by
        # flwr's make_ffn; without mods it is registered as it is.
        wrapped = sorted(name for name, fn in registered.items()
                         if getattr(fn, "__qualname__", "").endswith("wrap_ffn.<locals>.new_ffn"))
        if wrapped:
            raise RefusedError(
                f"{where} registers {', '.join(wrapped)} with mods: mods wrap the messages "
                f"between Flower's SuperNode and the app (secure aggregation, clipping, local "
                f"DP), a layer meshkit does not have; clipping, noise and secure aggregation "
                f"are meshkit components chosen in the config instead. Register the functions "
                f"without mods")
        self.app = app
        self.can_evaluate = any(name.startswith("evaluate.") for name in registered)

    def _call(self, context: Context, record: ArrayRecord, config: Mapping[str, Any],
              message_type: str) -> RecordDict:
        content = RecordDict({"arrays": record, "config": ConfigRecord(dict(config))})
        try:
            return send(self.app, context, content, message_type)
        except ValueError as exc:
            if "registered" not in str(exc):
                raise
            raise ConfigError(f"the ClientApp has no @app.{message_type}() function ({exc}); "
                              f"meshkit sends it {message_type!r} messages") from None

    def train(self, context: Context, record: ArrayRecord, config: Mapping[str, Any],
              weight_key: str, where: str) -> tuple[ArrayRecord, float, dict[str, float]]:
        """A train message: (the reply's arrays, its weight, its other metrics)."""
        reply = self._call(context, record, config, "train")
        arrays = list(reply.array_records.values())
        if len(arrays) != 1:
            raise MeshError(f"{where}: the train reply holds {len(arrays)} ArrayRecords; "
                            f"Flower's FedAvg and meshkit take exactly one (the model)")
        weight, metrics = self._metrics(reply, weight_key, where)
        return arrays[0], weight, metrics

    def evaluate(self, context: Context, record: ArrayRecord, config: Mapping[str, Any],
                 weight_key: str, where: str) -> tuple[float, dict[str, float]]:
        """An evaluate message: (its weight, its other metrics)."""
        return self._metrics(self._call(context, record, config, "evaluate"), weight_key,
                             where)

    @staticmethod
    def _metrics(reply: RecordDict, weight_key: str, where: str
                 ) -> tuple[float, dict[str, float]]:
        records = list(reply.metric_records.values())
        if not records or weight_key not in records[0]:
            raise MeshError(
                f"{where}: the reply's MetricRecord has no {weight_key!r}, the weight Flower's "
                f"FedAvg (weighted_by_key) and meshkit's fedavg use; add it (e.g. "
                f"\"num-examples\": len(trainloader.dataset)), or set [task] "
                f"weighted_by_key to the key your app reports")
        weight = float(records[0][weight_key])
        if not np.isfinite(weight) or weight < 0:
            raise MeshError(f"{where}: {weight_key!r} = {weight!r}; a weight is a finite "
                            f"number of at least 0")
        return weight, numbers(records[0], where, skip=weight_key)


def to_record(state: Mapping[str, Any], order: Sequence[str]) -> ArrayRecord:
    """A meshkit state as the ``ArrayRecord`` a Message-API app receives, in ``order``."""
    return ArrayRecord({key: Array(np.asarray(state[key])) for key in order})


def to_state(record: ArrayRecord) -> dict[str, Any]:
    """An ``ArrayRecord`` as a meshkit state (its keys, dtypes and shapes)."""
    return {str(key): array.numpy() for key, array in record.items()}
