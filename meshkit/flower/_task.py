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
(:class:`AppClientFn`): the same calls, as Flower's legacy messages. A
Message-API ``ClientApp`` (``@app.train()``, ``@app.evaluate()``) gets the
messages Flower's ``FedAvg`` sends (:mod:`meshkit.flower._message`), its
initial model from ``[task] initial`` (:mod:`meshkit.flower._initial`), which
a ``client_fn`` may use too instead of its ``get_parameters``. An app with
mods is refused saying why.

The client loads its own data from ``partition-id``, as in Flower, so the task
is a population (:mod:`meshkit.population`) of ``num_partitions`` clients whose
data is one row holding the partition id: client ``c`` fits, and with
``[strategy] evaluate = "clients"`` evaluates, partition ``c``, with no
``[partitioner]``; ``[strategy] clients`` may be left out or must say the same
number (``meshkit check`` refuses another). ``num_partitions`` left out is
``[strategy] clients``. A client is built afresh by ``client_fn`` for every
call, as Flower's simulation does; ``context.state`` persists per partition on
the node that serves it.
"""

from __future__ import annotations

import logging
import random
import sys
from typing import Any, Callable, Mapping

import numpy as np
from flwr.app import Context, RecordDict
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
from meshkit.flower import _message
from meshkit.flower._initial import as_array_record, load_initial
from meshkit.flower._message import MessageApp, numbers, send
from meshkit.flower._options import AppOptions, FlowerOptions

__all__ = ["AppClient", "AppClientFn", "FlowerTask", "MessageApp", "task", "app_task",
           "load_client_fn", "to_state", "to_parameters", "PARAMETER_PREFIX"]

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


def _check_ok(status: Any, what: str) -> None:
    if status is not None and status.code != Code.OK:
        raise MeshError(f"the Flower client's {what} returned status {status.code.name}: "
                        f"{status.message}")


class FlowerTask:
    """The meshkit task contract over a Flower client (see the module docstring).

    ``client_fn`` is a Flower ``client_fn`` (or :class:`AppClientFn`), or a
    :class:`MessageApp`; ``initial`` a callable returning the initial model
    (else ``[task] initial`` names one, else a ``client_fn``'s client is asked).
    """

    def __init__(self, client_fn: Callable[[Context], Any] | MessageApp, options: FlowerOptions,
                 *, initial: Callable[[], Any] | None = None) -> None:
        if options.num_partitions < 1:
            raise ConfigError(
                "[task] num_partitions: not given, and neither is [strategy] clients; set "
                "[strategy] clients = N, the number of Flower partitions (meshkit client c "
                "is partition-id c, and num_partitions follows clients)")
        if initial is None and options.initial:
            initial = load_initial(options.initial)
        if isinstance(client_fn, MessageApp) and initial is None:
            raise ConfigError(
                "[task] initial: a Message-API ClientApp (@app.train) takes its initial model "
                "from the ServerApp, and has no client-side get_parameters to ask; name what "
                "your ServerApp builds it with, e.g. initial = \"pkg.task:Net\" (a callable "
                "or class returning an nn.Module, a state_dict, an ArrayRecord or a list of "
                "arrays)")
        self.client_fn = client_fn
        self.options = options
        self.initial = initial
        self._contexts: dict[int, Context] = {}
        #: A Message-API app's state keys in the initial model's order (once known).
        self._order: list[str] | None = None

    @property
    def _messages(self) -> MessageApp | None:
        return self.client_fn if isinstance(self.client_fn, MessageApp) else None

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
        if self._messages is not None:
            raise MeshError("a Message-API ClientApp has no Client; it is sent messages")
        made = self.client_fn(self.context(partition))  # type: ignore[operator]
        if isinstance(made, NumPyClient):
            made = made.to_client()  # what Flower's own message handler does
        if not isinstance(made, Client):
            raise ConfigError(f"client_fn returned a {type(made).__name__}; a Flower client_fn "
                              f"returns a NumPyClient (or NumPyClient.to_client()) or a Client")
        return made

    def _initial_record(self) -> Any:
        assert self.initial is not None
        record = as_array_record(self.initial(), f"[task] initial ({_label(self.initial)})")
        self._order = [str(k) for k in record]
        return record

    def _record(self, state: Mapping[str, Any]) -> Any:
        """``state`` as the ``ArrayRecord`` a Message-API app receives (the initial's order)."""
        if self._order is None:
            self._initial_record()  # only its keys' order is kept (values never used)
        assert self._order is not None
        if set(self._order) != set(state):
            raise MeshError(f"the model's keys {sorted(state)} are not the initial model's "
                            f"{sorted(self._order)}")
        return _message.to_record(state, self._order)

    # -- the meshkit task contract ---------------------------------------------

    def population(self) -> int:
        """One meshkit client per Flower partition (:mod:`meshkit.population`)."""
        return self.options.num_partitions

    def client_data(self, client: int) -> tuple[np.ndarray, np.ndarray]:
        """Client ``client``'s one row: its partition id (its client loads the data)."""
        return np.array([[client]], dtype=np.int64), np.zeros(1, dtype=np.int64)

    def client_test_data(self, client: int) -> tuple[np.ndarray, np.ndarray]:
        """The same row: a client evaluates on its own partition's held-out data."""
        return self.client_data(client)

    def train_data(self) -> tuple[np.ndarray, np.ndarray]:
        """One row per partition holding its id (what a strategy without clients sees)."""
        ids = np.arange(self.options.num_partitions, dtype=np.int64).reshape(-1, 1)
        return ids, np.zeros(len(ids), dtype=np.int64)

    def test_data(self) -> tuple[np.ndarray, np.ndarray]:
        """The same rows: each partition evaluates on its own held-out data."""
        return self.train_data()

    def init_state(self, seed: int) -> dict[str, Any]:
        _seed(seed)
        if self.initial is not None:
            record = self._initial_record()
            if self._messages is not None:
                return _message.to_state(record)
            return to_state(record.to_numpy_ndarrays())
        res = self.client(0).get_parameters(GetParametersIns(config={}))
        _check_ok(getattr(res, "status", None), "get_parameters")
        parameters = parameters_to_ndarrays(res.parameters)
        if not parameters:
            raise ConfigError("the Flower client's get_parameters returned no parameters; "
                              "meshkit needs the initial model from it (or from [task] "
                              "initial)")
        return to_state(parameters)

    def _partition(self, x: np.ndarray) -> int:
        ids = np.asarray(x).reshape(len(x), -1)[:, 0] if len(x) else np.zeros(0)
        if len(ids) != 1:
            raise ConfigError(
                f"a meshkit client here holds {len(ids)} Flower partitions; each Flower "
                f"client is one partition, so use [strategy] name = \"federated\" (whose "
                f"client c is partition-id c of {self.options.num_partitions})")
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
        where = f"partition {partition} fit"
        if self._messages is not None:
            record = self._record(state)
            _seed(seed)
            arrays, weight, metrics = self._messages.train(
                self.context(partition), record, self._fit_config(), self.options.weighted_by_key,
                where)
            fitted = _message.to_state(arrays)
            if set(fitted) != set(state):
                raise MeshError(f"{where}: the reply's arrays {sorted(fitted)} are not the "
                                f"model's {sorted(state)}")
            return FitResult(fitted, _examples(weight, self.options.weighted_by_key, where),
                             metrics)
        _seed(seed)
        res = self.client(partition).fit(FitIns(
            parameters=ndarrays_to_parameters(to_parameters(state)),
            config=self._fit_config()))
        _check_ok(getattr(res, "status", None), "fit")
        parameters = parameters_to_ndarrays(res.parameters)
        if len(parameters) != len(state):
            raise MeshError(f"partition {partition}: fit returned {len(parameters)} parameters "
                            f"for a model of {len(state)}")
        return FitResult(to_state(parameters), int(res.num_examples), numbers(res.metrics, where))

    def _fit_config(self) -> dict[str, Any]:
        return dict(self.options.fit_config or self.options.train_config)

    def evaluate(self, state: Mapping[str, Any], x: np.ndarray | None = None,
                 y: np.ndarray | None = None) -> dict[str, float]:
        one = x is not None and len(x) == 1
        if x is None:  # the coordinator: every partition, as Flower's fraction_evaluate = 1
            partitions: Any = range(self.options.num_partitions)
        elif len(x) == 1:  # one client, on its own partition
            partitions = [int(np.asarray(x).reshape(1, -1)[0, 0])]
        else:
            raise ConfigError(
                f"a client was asked to evaluate {len(x)} Flower partitions at once; each "
                f"Flower client evaluates its own partition (meshkit client c is partition-id "
                f"c with [strategy] name = \"federated\")")
        if self._messages is not None and not self._messages.can_evaluate:
            # As Flower's FedAvg with no evaluate function: the round has no
            # evaluation to report (its metrics row carries the fits' figures).
            return {}
        total = 0.0
        sums: dict[str, float] = {}
        for partition, n, figures in self._evaluations(state, partitions):
            total += n
            for key, value in figures.items():
                sums[key] = sums.get(key, 0.0) + n * value
        if total == 0:
            raise MeshError("the Flower clients evaluated on 0 examples; nothing to report")
        # Flower's weighted_loss_avg and aggregate_metricrecords: weighted by examples.
        figures = {key: value / total for key, value in sums.items()}
        if one:  # one client's figures: the coordinator weighs them by its examples
            figures["examples"] = total
        return figures

    def _evaluations(self, state: Mapping[str, Any], partitions: Any) -> Any:
        """(partition, examples, figures) for each partition asked, as its client reports them."""
        config = dict(self.options.evaluate_config)
        if self._messages is not None:
            record = self._record(state)
            for partition in partitions:
                weight, figures = self._messages.evaluate(
                    self.context(partition), record, config, self.options.weighted_by_key,
                    f"partition {partition} evaluate")
                yield partition, weight, figures
            return
        parameters = ndarrays_to_parameters(to_parameters(state))
        for partition in partitions:
            res = self.client(partition).evaluate(EvaluateIns(parameters=parameters,
                                                              config=config))
            _check_ok(getattr(res, "status", None), "evaluate")
            yield partition, int(res.num_examples), {
                "loss": float(res.loss), **numbers(res.metrics, f"partition {partition} evaluate")}


def _examples(weight: float, key: str, where: str) -> int:
    """A Message-API reply's weight as meshkit's realized work (a whole number of examples)."""
    if weight != int(weight):
        raise MeshError(f"{where}: {key!r} = {weight!r}; meshkit weighs a contribution by the "
                        f"whole number of examples it saw (fedavg's weight), so report a count")
    return int(weight)


def _label(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', type(obj).__name__)}"


def task(client_fn: Callable[[Context], Any] | ClientApp, *,
         initial: Callable[[], Any] | None = None) -> Component:
    """A meshkit task (a :class:`meshkit.Component`) from a Flower ``client_fn`` or ``ClientApp``.

    A ``ClientApp`` built from a ``client_fn`` (and no mods) runs through the
    app (:class:`AppClientFn`); a Message-API one (``@app.train()``) gets
    Flower's train and evaluate messages and needs the initial model:
    ``initial``, a callable returning it (as ``[task] initial`` names one).

    Select it as ``[run] task = "module:attribute"`` naming the result, or pass
    it to ``meshkit.run`` as the ``[run] task`` value; its ``[task]`` keys are
    :class:`FlowerOptions`.
    """
    label = getattr(client_fn, "__qualname__", None) or type(client_fn).__name__
    checked = _check_client_fn(client_fn, f"meshkit.flower.task({label})")
    if initial is not None and not callable(initial):
        raise ConfigError(f"meshkit.flower.task({label}, initial=...): expected a callable (or "
                          f"class) returning the initial model, got {type(initial).__name__}")
    name = f"flower:{getattr(client_fn, '__module__', type(client_fn).__module__)}.{label}"
    return Component(name, lambda options: FlowerTask(checked, options, initial=initial),
                     FlowerOptions, summary="a Flower client_fn run as a meshkit task")


def app_task(options: AppOptions) -> FlowerTask:
    """The registered task ``flower``: the ``client_fn`` named by ``[task] app``."""
    return FlowerTask(load_client_fn(options.app), options)


def load_client_fn(reference: str) -> Callable[[Context], Any] | MessageApp:
    """The Flower ``client_fn`` (or ``ClientApp``) at ``"module:attribute"``, refusing what
    does not map."""
    module_name, sep, attribute = reference.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigError(f"[task] app = {reference!r}: expected \"module:attribute\" naming "
                          f"the Flower client_fn")
    # The same lookup as a "module:attribute" [run] task: the current directory
    # importable, a clear error for a missing module or attribute.
    return _check_client_fn(import_reference(reference), f"[task] app = {reference!r}")


def _check_client_fn(obj: Any, where: str) -> Callable[[Context], Any] | MessageApp:
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
        if getattr(obj, "_call", None) is None:  # no client_fn: the Message API
            return MessageApp(obj, where)
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


class AppClient(Client):
    """One ``ClientApp`` call per request, as Flower's ``Client`` (see :class:`AppClientFn`)."""

    def __init__(self, app: ClientApp, context: Context) -> None:
        self.app, self.context = app, context

    def _send(self, content: RecordDict, message_type: str) -> RecordDict:
        return send(self.app, self.context, content, message_type)

    def get_parameters(self, ins: GetParametersIns) -> GetParametersRes:
        return recorddict_to_getparametersres(
            self._send(getparametersins_to_recorddict(ins), "get_parameters"), keep_input=False)

    def fit(self, ins: FitIns) -> FitRes:
        return recorddict_to_fitres(self._send(fitins_to_recorddict(ins, keep_input=True),
                                               "train"), keep_input=False)

    def evaluate(self, ins: EvaluateIns) -> EvaluateRes:
        return recorddict_to_evaluateres(
            self._send(evaluateins_to_recorddict(ins, keep_input=True), "evaluate"))
