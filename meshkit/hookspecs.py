"""Every hook meshkit calls, with when it is called and what it must do.

A plugin implements any subset of these with :data:`meshkit.hookimpl`.
Component hooks return records and change no kernel state; one that raises
or returns anything but :class:`meshkit.Component` records costs only its own
plugin's components of that kind (:mod:`meshkit.registry`). Event hooks are
for observers (loggers, dashboards): they are called one observer at a time
through :func:`meshkit.plugins.notify`, their return values are ignored, and
one that raises is logged with its plugin's name while the run goes on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import pluggy

if TYPE_CHECKING:  # the kernel's types, named here without importing them at run time
    from meshkit.components import Component
    from meshkit.config import Config
    from meshkit.node import NodeCaps
    from meshkit.train import RoundReport, RunReport

# The spec marker stays private: plugins only ever need ``meshkit.hookimpl``.
_hookspec = pluggy.HookspecMarker("meshkit")


# -- component hooks ---------------------------------------------------------


@_hookspec
def meshkit_transports() -> Iterable[Component]:
    """Offer transports: how ranks reach each other.

    Called once per plugin manager, the first time a transport is listed or
    selected. Return an iterable of :class:`meshkit.Component` records whose
    ``factory(options)`` builds an object with ``connect(node_config) ->
    Group``. Must not import heavy libraries or open sockets.
    """


@_hookspec
def meshkit_aggregators() -> Iterable[Component]:
    """Offer aggregators: how contributions are combined into one state.

    Called once per plugin manager, the first time an aggregator is listed or
    selected. Return :class:`meshkit.Component` records whose factory builds
    an object with ``aggregate(states, weights=None) -> state`` and,
    optionally, the streaming form ``begin() -> fold``.
    """


@_hookspec
def meshkit_outer_optimizers() -> Iterable[Component]:
    """Offer outer optimizers: how the global model steps from a consensus.

    Called once per plugin manager, the first time an outer optimizer is
    listed or selected. Return :class:`meshkit.Component` records whose
    factory builds an object with ``step(global_state, consensus) ->
    new_global``, ``state_dict()`` and ``load_state_dict(d)``.
    """


@_hookspec
def meshkit_boards() -> Iterable[Component]:
    """Offer fixed-function board drivers.

    Called once per plugin manager, the first time a board is listed or
    selected. Return :class:`meshkit.Component` records whose factory builds
    a driver with a ``descriptor`` (:class:`meshkit.FixedFunction`) and
    ``execute(x) -> y``.
    """


@_hookspec
def meshkit_strategies() -> Iterable[Component]:
    """Offer training strategies: how a run is organised.

    Called once per plugin manager, the first time a strategy is listed or
    selected. Return :class:`meshkit.Component` records whose factory builds
    a strategy driven from the coordinator through a ``StrategyContext``.
    """


@_hookspec
def meshkit_tasks() -> Iterable[Component]:
    """Offer tasks: a user's model and data.

    Called once per plugin manager, the first time a task is listed or
    selected by registered name. Return :class:`meshkit.Component` records
    whose factory builds a task (initial state, fit, gradients, evaluate,
    stage).
    """


@_hookspec
def meshkit_partitioners() -> Iterable[Component]:
    """Offer partitioners: how a training set is split into the clients of a federation.

    Called once per plugin manager, the first time a partitioner is listed
    or selected (``[partitioner] name``). Return :class:`meshkit.Component`
    records whose factory builds an object with ``split(labels, clients, *,
    seed) -> parts`` (:class:`meshkit.partitioner.Partitioner`): a pure
    function of its arguments and options, every row in exactly one part.
    """


@_hookspec
def meshkit_privacy() -> Iterable[Component]:
    """Offer privacy mechanisms: how a federated round is made differentially private.

    Called once per plugin manager, the first time a privacy mechanism is
    listed or selected (``[privacy] name``). Return :class:`meshkit.Component`
    records whose factory builds a :class:`meshkit.privacy.PrivacyMechanism`:
    it clips, noises and accounts each round the ``federated`` strategy plays.
    """


@_hookspec
def meshkit_observers() -> Iterable[Component]:
    """Offer observers: trackers (TensorBoard, MLflow, ...) a config selects by name.

    Called once per plugin manager, the first time an observer is listed or
    selected (``[[observers]] name``). Return :class:`meshkit.Component`
    records whose ``factory(options)`` builds an object implementing any of
    ``meshkit_run_started``, ``meshkit_round_completed`` and
    ``meshkit_run_finished`` with :data:`meshkit.hookimpl`; the coordinator
    calls those for the run that selected it, one observer at a time, and
    one that raises is logged with its name while the run goes on. The
    factory must not open files or connections: that belongs in
    ``meshkit_run_started``.
    """


@_hookspec
def meshkit_attacks() -> Iterable[Component]:
    """Offer attacks: how a chosen client poisons its contribution, to test a defence.

    Called once per plugin manager, the first time an attack is listed or
    selected (``[attack] name``, or ``meshkit node --attack NAME``). Return
    :class:`meshkit.Component` records whose factory builds an object with
    ``tamper(update, round) -> update`` (:class:`meshkit.attack.Attack`),
    optionally ``omniscient = True`` (it reads the round's honest updates)
    or ``poisons_data = True`` with ``poison(x, y, *, classes) -> (x, y)``.
    """


@_hookspec
def meshkit_exporters() -> Iterable[Component]:
    """Offer exporters: the file formats ``meshkit export --format NAME`` writes a model in.

    Called once per plugin manager, the first time an exporter is listed or
    selected (``meshkit export --format NAME``). Return
    :class:`meshkit.Component` records whose factory builds an object with
    ``export(source, file) -> Path`` (:class:`meshkit.exporter.Exporter`):
    ``source`` a run directory or checkpoint file, ``file`` replaced
    atomically. The factory must import nothing heavy (torch is imported by
    ``export``, never to list or select another format).
    """


@_hookspec
def meshkit_compression() -> Iterable[Component]:
    """Offer compressors: how a worker shrinks the update it uploads (``[compression]``).

    Called once per plugin manager, the first time a compressor is listed or
    selected (``[compression] name``; a worker builds the one its fit request
    names). Return :class:`meshkit.Component` records whose ``factory(options)``
    builds a :class:`meshkit.compression.Compressor`: ``encode(x, *, seed) ->
    fields`` on the worker, ``decode(fields, size) -> x`` and ``bounds(size)``
    on the coordinator, and its ``traits`` (a
    :class:`meshkit.compression.CompressionTraits`), by which the kernel decides
    what it composes with. The factory must be a pure function of its options:
    coordinator and workers build their own and must agree.
    """



@_hookspec
def meshkit_secure_aggregation() -> Iterable[Component]:
    """Offer secure-aggregation schemes: how a round's updates are masked so only their sum shows.

    Called once per plugin manager, the first time a scheme is listed or
    selected (``[secure_aggregation] name``, on the coordinator; by a worker
    when a round's keys request names it). Return :class:`meshkit.Component`
    records whose factory builds a :class:`meshkit.secure_aggregation.Scheme`:
    it declares :class:`~meshkit.secure_aggregation.SecureAggregationTraits`
    (its field, row widths, dropout tolerance) and gives the kernel's round
    its coordinator and client sides. The factory must import nothing heavy.
    """

# -- event hooks -------------------------------------------------------------


@_hookspec
def meshkit_run_started(config: Config) -> None:
    """A run is about to start.

    Called on the coordinator once, after the config is resolved and before
    any worker is contacted. ``config`` is the resolved
    :class:`meshkit.config.Config`. The return value is ignored.
    """


@_hookspec
def meshkit_node_joined(caps: NodeCaps) -> None:
    """A node finished the capability handshake.

    Called on the coordinator once per node, in rank order of arrival, with
    the node's :class:`meshkit.NodeCaps` as it advertised them. The return
    value is ignored.
    """


@_hookspec
def meshkit_round_completed(report: RoundReport) -> None:
    """A training round (or data-parallel step batch) finished.

    Called on the coordinator after the round's consensus is scattered and
    its metrics are recorded. ``report`` carries the round number, who
    answered, and the metrics (a :class:`meshkit.train.RoundReport`). The
    return value is ignored.
    """


@_hookspec
def meshkit_run_finished(report: RunReport) -> None:
    """A run ended, successfully or not.

    Called on the coordinator once, after the last round or after a failure
    stopped the run; ``report`` (a :class:`meshkit.train.RunReport`) says
    which. The return value is ignored.
    """
