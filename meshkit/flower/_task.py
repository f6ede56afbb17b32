"""A Flower client factory as a meshkit task: how each meshkit call becomes a Flower call.

===========================  ==================================================
meshkit                      Flower
===========================  ==================================================
meshkit client ``c`` of      ``context.node_config = {"partition-id": c,
``num_partitions``           "num-partitions": num_partitions}``
``[task.run_config]``        ``context.run_config``
``init_state(seed)``         ``client_fn(context of partition 0)
                             .get_parameters({})``, after seeding ``random``,
                             numpy's global RNG and torch (when imported)
                             with ``seed``: Flower asks one client too
state key ``p000, p001...``  the parameter list, in order (dtypes and shapes
                             kept)
``fit(state, x, y, seed)``   ``client_fn(context).fit(parameters,
                             fit_config)`` through Flower's own ``Client``
                             interface (``FitIns`` in, ``FitRes`` out) after
                             seeding with ``seed``; ``num_examples`` is the
                             fit's realized work (fedavg's weight); numeric
                             metrics are kept
``evaluate(state[, x, y])``  ``evaluate(parameters, evaluate_config)`` on every
                             partition asked for (all of them on the
                             coordinator), the loss and each numeric metric
                             averaged weighted by ``num_examples``: what
                             Flower's ``weighted_loss_avg`` and a
                             ``weighted_average`` metrics aggregation give
===========================  ==================================================

A ``ClientApp`` built from a ``client_fn`` is run through the app itself
(:class:`AppClientFn`): the same calls, as Flower's legacy messages. One
with mods, or a Message-API app, is refused saying why.

The client loads its own data from ``partition-id``, as in Flower, so the
training set meshkit shards is one row per partition holding its id
(:meth:`FlowerTask.train_data`): with ``[strategy] clients = num_partitions``
and the default contiguous partitioner, client ``c`` fits partition ``c``.
A client is built afresh by ``client_fn`` for every call, as Flower's
simulation does; ``context.state`` persists per partition on the node that
serves it.
"""

from __future__ import annotations

import itertools
import logging
import random
import sys
import time
from typing import Any, Callable, Mapping

import numpy as np
from flwr.app import DEFAULT_TTL, Context, Message, Metadata, RecordDict
from flwr.client import Client, ClientApp, NumPyClient
from flwr.common import (Code, EvaluateIns, EvaluateRes, FitIns, FitRes, GetParametersIns,
                         GetParametersRes, ndarrays_to_parameters, parameters_to_ndarrays)
from flwr.compat.common.recorddict_compat import (evaluateins_to_recorddict, fitins_to_recorddict,
                                                  getparametersins_to_recorddict,
                                                  recorddict_to_evaluateres,
                                                  recorddict_to_fitres,
                                                  recorddict_to_getparametersres)

from meshkit.components import Component
from meshkit.errors import ConfigError, MeshError, RefusedError
from meshkit.task import FitResult, import_reference
from meshkit.flower._options import AppOptions, FlowerOptions

__all__ = ["AppClient", "AppClientFn", "FlowerTask", "task", "app_task", "load_client_fn",
           "to_state", "to_parameters", "PARAMETER_PREFIX"]

log = logging.getLogger(__name__)

#: State keys are ``p000``, ``p001``, ...: the parameter list's order, sortable.
PARAMETER_PREFIX = "p"

_SERVER_SIDE = {
    "ServerApp": "a ServerApp is Flower's server side",
    "Strategy": "a Flower Strategy runs on Flower's server",
    "Server": "a Flower Server runs the server loop",
}
_INSTEAD = ("meshkit's coordinator is the server: select [strategy] name = \"federated\" "
            "(rounds, clients, fraction), an [aggregator] (fedavg, ...) and an "
            "[outer_optimizer] (fedadam, fedyogi, fedavgm, ...) in the config, and point "
            "[task] app at the client_fn (docs/coming-from-flower.md)")


def _key(index: int) -> str:
    return f"{PARAMETER_PREFIX}{index:03d}"


def _index(key: str) -> int:
    digits = key[len(PARAMETER_PREFIX):]
    if not key.startswith(PARAMETER_PREFIX) or not digits.isdigit():
        raise MeshError(f"state key {key!r} is not a Flower parameter ({PARAMETER_PREFIX}000, "
                        f"{PARAMETER_PREFIX}001, ...)")
    return int(digits)


def to_state(parameters: list[np.ndarray]) -> dict[str, Any]:
    """A Flower parameter list as a meshkit state, in order."""
    return {_key(i): np.asarray(p) for i, p in enumerate(parameters)}


def to_parameters(state: Mapping[str, Any]) -> list[np.ndarray]:
    """A meshkit state back as the parameter list, ordered by index (not by dict order)."""
    ordered = sorted(state.items(), key=lambda kv: _index(kv[0]))
    if [_index(k) for k, _ in ordered] != list(range(len(ordered))):
        raise MeshError(f"Flower parameter keys {sorted(state)} have gaps")
    return [np.asarray(v) for _, v in ordered]


def _seed(seed: int) -> None:
    """Seed what a Flower client's own randomness usually draws from."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch = sys.modules.get("torch")  # only if the client imported it: never import torch here
    if torch is not None:
        torch.manual_seed(seed)


def _numbers(metrics: Mapping[str, Any], where: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in dict(metrics or {}).items():
        if isinstance(value, (bool, int, float, np.number)):
            out[str(key)] = float(value)
        else:
            log.debug("%s: metric %r is a %s, not a number; meshkit records numbers only",
                      where, key, type(value).__name__)
    return out


def _check_ok(status: Any, what: str) -> None:
    if status is not None and status.code != Code.OK:
        raise MeshError(f"the Flower client's {what} returned status {status.code.name}: "
                        f"{status.message}")


class FlowerTask:
    """The meshkit task contract over a Flower ``client_fn`` (see the module docstring)."""

    def __init__(self, client_fn: Callable[[Context], Any], options: FlowerOptions) -> None:
        self.client_fn = client_fn
        self.options = options
        self._contexts: dict[int, Context] = {}

    # -- Flower side ----------------------------------------------------------

    def context(self, partition: int) -> Context:
        """The ``Context`` of partition ``partition`` (kept: its ``state`` persists here)."""
        if partition not in self._contexts:
            self._contexts[partition] = Context(
                run_id=0, node_id=partition + 1,
                node_config={"partition-id": partition,
                             "num-partitions": self.options.num_partitions},
                state=RecordDict(), run_config=dict(self.options.run_config))
        return self._contexts[partition]

    def client(self, partition: int) -> Client:
        """A fresh client for ``partition`` from ``client_fn``, as Flower's ``Client``."""
        made = self.client_fn(self.context(partition))
        if isinstance(made, NumPyClient):
            made = made.to_client()  # what Flower's own message handler does
        if not isinstance(made, Client):
            raise ConfigError(f"client_fn returned a {type(made).__name__}; a Flower client_fn "
                              f"returns a NumPyClient (or NumPyClient.to_client()) or a Client")
        return made

    # -- the meshkit task contract ---------------------------------------------

    def train_data(self) -> tuple[np.ndarray, np.ndarray]:
        """One row per partition holding its id: what meshkit shards into clients."""
        ids = np.arange(self.options.num_partitions, dtype=np.int64).reshape(-1, 1)
        return ids, np.zeros(len(ids), dtype=np.int64)

    def test_data(self) -> tuple[np.ndarray, np.ndarray]:
        """The same rows: each partition evaluates on its own held-out data."""
        return self.train_data()

    def init_state(self, seed: int) -> dict[str, Any]:
        _seed(seed)
        res = self.client(0).get_parameters(GetParametersIns(config={}))
        _check_ok(getattr(res, "status", None), "get_parameters")
        parameters = parameters_to_ndarrays(res.parameters)
        if not parameters:
            raise ConfigError("the Flower client's get_parameters returned no parameters; "
                              "meshkit needs the initial model from it")
        return to_state(parameters)

    def _partition(self, x: np.ndarray) -> int:
        ids = np.asarray(x).reshape(len(x), -1)[:, 0] if len(x) else np.zeros(0)
        if len(ids) != 1:
            raise ConfigError(
                f"a meshkit client here holds {len(ids)} Flower partitions; each Flower "
                f"client is one partition, so set [strategy] clients = {self.options.num_partitions} "
                f"([task] num_partitions) with the default contiguous partitioner")
        return int(ids[0])

    def fit(self, state: Mapping[str, Any], x: np.ndarray, y: np.ndarray, *,
            seed: int, time_budget: float | None = None) -> FitResult:
        if time_budget is not None:
            raise RefusedError(
                "[strategy] time_budget asks a fit to stop when its budget runs out and report "
                "the examples it processed; a Flower client's fit runs to its own end and "
                "reports its own num_examples. Remove time_budget (round_timeout still drops "
                "a straggler's answer for the round)")
        partition = self._partition(x)
        _seed(seed)
        res = self.client(partition).fit(FitIns(
            parameters=ndarrays_to_parameters(to_parameters(state)),
            config=dict(self.options.fit_config)))
        _check_ok(getattr(res, "status", None), "fit")
        parameters = parameters_to_ndarrays(res.parameters)
        if len(parameters) != len(state):
            raise MeshError(f"partition {partition}: fit returned {len(parameters)} parameters "
                            f"for a model of {len(state)}")
        return FitResult(to_state(parameters), int(res.num_examples),
                         _numbers(res.metrics, f"partition {partition} fit"))

    def evaluate(self, state: Mapping[str, Any], x: np.ndarray | None = None,
                 y: np.ndarray | None = None) -> dict[str, float]:
        if x is None:  # the coordinator: every partition, as Flower's fraction_evaluate = 1
            partitions: Any = range(self.options.num_partitions)
        elif len(x) == 1:  # one client, on its own partition
            partitions = [int(np.asarray(x).reshape(1, -1)[0, 0])]
        else:
            # Without a [partitioner] table a worker hands every client the whole
            # held-out set; each client's figure would be everyone's.
            raise ConfigError(
                f"a client was asked to evaluate {len(x)} Flower partitions; with [strategy] "
                f"evaluate = \"clients\" add [partitioner] name = \"contiguous\" so that each "
                f"client evaluates its own partition")
        parameters = ndarrays_to_parameters(to_parameters(state))
        total = 0
        sums: dict[str, float] = {}
        for partition in partitions:
            res = self.client(partition).evaluate(EvaluateIns(
                parameters=parameters, config=dict(self.options.evaluate_config)))
            _check_ok(getattr(res, "status", None), "evaluate")
            n = int(res.num_examples)
            total += n
            figures = {"loss": float(res.loss),
                       **_numbers(res.metrics, f"partition {partition} evaluate")}
            for key, value in figures.items():
                sums[key] = sums.get(key, 0.0) + n * value
        if total == 0:
            raise MeshError("the Flower clients evaluated on 0 examples; nothing to report")
        return {key: value / total for key, value in sums.items()}


def task(client_fn: Callable[[Context], Any] | ClientApp) -> Component:
    """A meshkit task (a :class:`meshkit.Component`) from a Flower ``client_fn``.

    A ``ClientApp`` built from a ``client_fn`` (and no mods) is accepted too:
    each call then goes through the app (:class:`AppClientFn`).

    Select it as ``[run] task = "module:attribute"`` naming the result; its
    ``[task]`` keys are :class:`FlowerOptions`.
    """
    label = getattr(client_fn, "__qualname__", None) or type(client_fn).__name__
    checked = _check_client_fn(client_fn, f"meshkit.flower.task({label})")
    name = f"flower:{getattr(client_fn, '__module__', type(client_fn).__module__)}.{label}"
    return Component(name, lambda options: FlowerTask(checked, options), FlowerOptions,
                     summary="a Flower client_fn run as a meshkit task")


def app_task(options: AppOptions) -> FlowerTask:
    """The registered task ``flower``: the ``client_fn`` named by ``[task] app``."""
    return FlowerTask(load_client_fn(options.app), options)


def load_client_fn(reference: str) -> Callable[[Context], Any]:
    """The Flower ``client_fn`` (or ``ClientApp``) at ``"module:attribute"``, refusing what
    does not map."""
    module_name, sep, attribute = reference.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigError(f"[task] app = {reference!r}: expected \"module:attribute\" naming "
                          f"the Flower client_fn")
    # The same lookup as a "module:attribute" [run] task: the current directory
    # importable, a clear error for a missing module or attribute.
    return _check_client_fn(import_reference(reference), f"[task] app = {reference!r}")


def _check_client_fn(obj: Any, where: str) -> Callable[[Context], Any]:
    kind = type(obj).__name__
    for cls in type(obj).__mro__:
        if cls.__name__ in _SERVER_SIDE and cls.__module__.startswith("flwr"):
            what = kind if kind == cls.__name__ else f"{kind} (a {cls.__name__})"
            raise RefusedError(f"{where} is a Flower {what}: {_SERVER_SIDE[cls.__name__]}, "
                               f"which meshkit does not run; {_INSTEAD}")
    if isinstance(obj, ClientApp):
        # Flower has no public accessor for an app's mods; read the attribute
        # its constructor sets, and refuse when there are any.
        if getattr(obj, "_mods", None):
            raise RefusedError(
                f"{where} is a ClientApp with mods: mods wrap the messages between Flower's "
                f"SuperNode and the app (secure aggregation, clipping, local DP), a layer "
                f"meshkit does not have; clipping, noise and secure aggregation are meshkit "
                f"components chosen in the config instead. Build the app without mods, or "
                f"point at its client_fn")
        return AppClientFn(obj)
    if isinstance(obj, (NumPyClient, Client)):
        raise ConfigError(f"{where} is a Flower {kind} instance; point at the client_fn that "
                          f"builds one (client_fn(context) -> client)")
    if not callable(obj):
        raise ConfigError(f"{where} is a {kind}, not a Flower client_fn")
    return obj


class AppClientFn:
    """A ``ClientApp`` built from a ``client_fn``, as a ``client_fn``: its clients talk messages.

    Each call goes through the app itself (``app(message, context)``, Flower's
    public way to run a ClientApp) with the legacy message contents Flower's
    own compatibility layer writes and reads, so the app's ``client_fn`` runs
    exactly as under a SuperNode.
    """

    def __init__(self, app: ClientApp) -> None:
        self.app = app

    def __call__(self, context: Context) -> Client:
        return AppClient(self.app, context)


_MESSAGE_IDS = itertools.count(1)


class AppClient(Client):
    """One ``ClientApp`` call per request, as Flower's ``Client`` (see :class:`AppClientFn`)."""

    def __init__(self, app: ClientApp, context: Context) -> None:
        self.app, self.context = app, context

    def _send(self, content: RecordDict, message_type: str) -> RecordDict:
        metadata = Metadata(run_id=0, message_id=str(next(_MESSAGE_IDS)), src_node_id=0,
                            dst_node_id=self.context.node_id, reply_to_message_id="",
                            group_id="", created_at=time.time(), ttl=DEFAULT_TTL,
                            message_type=message_type)
        try:
            # Message's typed overloads leave out metadata=, which its constructor
            # takes for a message that no SuperLink addressed (this one).
            message = Message(content=content, metadata=metadata)  # type: ignore[call-overload]
            reply = self.app(message, self.context)
        except ValueError as exc:
            if "message type" not in str(exc) and "registered" not in str(exc):
                raise
            raise RefusedError(
                f"this ClientApp has no client_fn to serve {message_type!r} ({exc}): it is a "
                f"Message-API app (@app.train, @app.evaluate), whose functions take their "
                f"initial model from the ServerApp and have no client-side get_parameters "
                f"for meshkit to ask. Wrap the train/evaluate bodies in a NumPyClient and "
                f"point [task] app at a client_fn returning it") from None
        if reply.has_error():
            raise MeshError(f"the ClientApp answered {message_type!r} with an error: "
                            f"{reply.error.reason}")
        return reply.content

    def get_parameters(self, ins: GetParametersIns) -> GetParametersRes:
        return recorddict_to_getparametersres(
            self._send(getparametersins_to_recorddict(ins), "get_parameters"), keep_input=False)

    def fit(self, ins: FitIns) -> FitRes:
        return recorddict_to_fitres(self._send(fitins_to_recorddict(ins, keep_input=True),
                                               "train"), keep_input=False)

    def evaluate(self, ins: EvaluateIns) -> EvaluateRes:
        return recorddict_to_evaluateres(
            self._send(evaluateins_to_recorddict(ins, keep_input=True), "evaluate"))
