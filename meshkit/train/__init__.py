"""Training runs: the strategy contract, the workers it drives, and the runner.

One idea per module (docs/architecture.md, "where to find things"):

* ``_strategy`` — the contract a strategy is written against
  (:class:`Strategy`, :class:`StrategyContext`, :class:`RoundReport`,
  :class:`StrategyResult`, :class:`RunStopped`);
* ``_traits`` — what a strategy declares it is, everything the kernel reads
  of one (:class:`StrategyTraits`, :func:`strategy_traits`);
* ``_rounds`` — how a round is played: ``_rounds.skeleton``, the loop every
  strategy shares (:func:`run_rounds`, :class:`RoundOutcome`);
  ``_rounds.work``, what every path takes and gives back (:class:`Work`,
  :class:`Folded`); ``_rounds.engine``, the one round engine -- which path a
  round takes, and the flat round: contributions folded in key order, a
  bounded number held at once, lost workers' work served again
  (:func:`fold_round`); ``_rounds.scheduler``, the scheduler the flat and
  batched rounds share; one module per other path: ``_rounds.batched``,
  ``_rounds.collective`` (every rank plays its slice, one exact partial, one
  all-reduce: :class:`PartialReducer`, :func:`cohort_slice`),
  ``_rounds.relayed`` (host relays, one partial per relay),
  ``_rounds.secure``; ``_rounds.compressed``, a compressed round's fits;
* ``_broadcast`` — ``[compression] broadcast``: the model sent down as a
  compressed delta against what each worker holds (:class:`Broadcast`);
* ``_sharding`` — which rows a client trains on, which clients a round
  asks, and the seed of each fit;
* ``_partitions`` — model-parallel stages: ordering, validation, pinning;
* ``_local_keys`` — each client's own values of ``[strategy] local_keys``;
* ``_protocol`` — the trainer requests and replies' framing, and their tags;
  ``_messages`` — every message's fields, types and bounds, and where they are
  checked (``_messages.check``: :func:`check_contribution`);
* ``_failures`` — what a member's failure costs (:class:`RoundFailures`);
* ``_worker`` — the worker side: ``_worker.trainer`` (:class:`Trainer`,
  :func:`serve_trainer`), ``_worker.local_sgd`` (a DiLoCo replica,
  :func:`split_fragments`, :func:`state_digest`, :func:`apply_update`),
  ``_worker.secure`` (the clients it plays in a secure round),
  ``_worker.node_job`` (the node's ``"train"`` job, :func:`serve_train_job`);
* ``_pool`` — reaching the workers, and where a dead rank leaves a round:
  liveness is the transport's dead ledger (:class:`GroupPool`,
  :class:`LocalPool`), and one request for many ranks (:func:`broadcast`);
* ``_relay`` — a host relay's side: ``_relay.host`` (its pool over its ranks,
  its answers: :class:`RelayPool`), ``_relay.secure`` (its masked sum);
* ``_attacks`` — a simulated ``[attack]``: the coordinator poisons the
  chosen clients' contributions (:class:`AttackPlan`, :class:`AttackedFold`);
* ``_coordinator`` — the coordinator's side: ``_coordinator.plan`` (what a
  config resolves to against the plugins: :class:`Plan`, :func:`resolve`,
  and :func:`check`, what ``meshkit check`` runs), ``_coordinator.preflight``
  (everything a run refuses before any process starts, so ``meshkit check``
  refuses the same: :func:`build_components`), ``_coordinator.launch`` (the
  local worker processes and their per-run secret), ``_coordinator.runner``
  (``meshkit run`` from one config: :class:`Runner`, :func:`run`),
  ``_coordinator.report`` (what a run reports: :class:`RunReport`,
  :class:`RunEvent`, :class:`Interrupted`),
  ``_coordinator.resume``, ``_coordinator.artifacts`` (what a run leaves in
  ``out``: ``metrics.jsonl``, ``summary.json``, ``report.png``),
  ``_coordinator.progress``, ``_coordinator.observers``.

Strategy plugins import from here, never from a ``_private`` module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshkit._lazy import on_first_use

if TYPE_CHECKING:
    from meshkit.train._rounds.collective import PartialReducer, check_collective, cohort_slice
    from meshkit.train._coordinator.artifacts import METRICS_NAME, REPORT_NAME, read_metrics
    from meshkit.train._rounds.engine import (
        DEFAULT_WINDOW,
        HOLD,
        INLINE_BYTES,
        Folded,
        Work,
        by_examples,
        once,
        fold_round,
        answer_relay_request,
        train_loss,
    )
    from meshkit.train._messages.relay import FanoutRequest, FoldRequest, parse_relay_request
    from meshkit.train._relay.host import RelayPool, RelayRanks
    from meshkit.train._local_keys import ClientLocal, resolve_local_keys
    from meshkit.train._trainable import Trainable
    from meshkit.train._broadcast import Broadcast
    from meshkit.train._attacks import AttackedFold, AttackPlan
    from meshkit.train._failures import (QUARANTINE_AFTER, DivergedFit, RoundFailures, reply_failure,
                                         strike)
    from meshkit.train._messages import check_contribution, signature
    from meshkit.train._worker.node_job import node_attack, serve_train_job
    from meshkit.train._worker.secure import Signing
    from meshkit.train._partitions import Partition, WorkerIdentity, order_partitions
    from meshkit.train._coordinator.launch import free_ports
    from meshkit.train._pool import GroupPool, LocalPool, Reply, WorkerPool, broadcast, call
    from meshkit.train._coordinator.progress import format_event, format_metrics, format_result, format_round
    from meshkit.train._protocol import TAG_REPLY, TAG_REQUEST, decode, encode
    from meshkit.train._rounds.skeleton import RoundOutcome, run_rounds, timed
    from meshkit.train._traits import StrategyTraits, strategy_traits
    from meshkit.train._coordinator.preflight import build_components
    from meshkit.train._coordinator.plan import Plan, check, resolve
    from meshkit.train._coordinator.report import Interrupted, RunEvent, RunReport
    from meshkit.train._coordinator.runner import Runner, load_run_config, run
    from meshkit.train._sharding import (client_seed, cohort_size, poisson_clients, sample_clients,
                                         shard_bounds, shard_pair)
    from meshkit.train._strategy import (
        RoundReport,
        RunStopped,
        Strategy,
        StrategyContext,
        StrategyResult,
        weighted_mean,
    )
    from meshkit.train._worker.trainer import Trainer, serve_trainer, with_device
    from meshkit.train._worker.local_sgd import (apply_update, decode_update, outer_update,
                                                 pseudo_gradients, split_fragments, state_digest)
    from meshkit.train._rounds.secure import SecureSum, round_params, secure_sum

#: Where each public name lives. A name's module loads the first time the name
#: is used, not with the package: a ``meshkit node`` that serves a round needs
#: the worker's side (``serve_train_job``), never the coordinator, the round
#: paths or the runner, and each process a run starts paid for all of them
#: (docs/benchmarks.md, issue ci2). The imports above are the same names for
#: the type checker; tests/kernel/test_lazy_imports.py keeps the two in step.
_MODULES: dict[str, tuple[str, ...]] = {
    "meshkit.train._rounds.collective": ("PartialReducer", "check_collective", "cohort_slice"),
    "meshkit.train._coordinator.artifacts": ("METRICS_NAME", "REPORT_NAME", "read_metrics"),
    "meshkit.train._rounds.engine": (
        "DEFAULT_WINDOW", "HOLD", "INLINE_BYTES", "Folded", "Work", "by_examples", "once",
        "fold_round", "answer_relay_request", "train_loss",
    ),
    "meshkit.train._messages.relay": ("FanoutRequest", "FoldRequest", "parse_relay_request"),
    "meshkit.train._relay.host": ("RelayPool", "RelayRanks"),
    "meshkit.train._local_keys": ("ClientLocal", "resolve_local_keys"),
    "meshkit.train._trainable": ("Trainable",),
    "meshkit.train._broadcast": ("Broadcast",),
    "meshkit.train._attacks": ("AttackedFold", "AttackPlan"),
    "meshkit.train._failures": (
        "QUARANTINE_AFTER", "DivergedFit", "RoundFailures", "reply_failure", "strike",
    ),
    "meshkit.train._messages": ("check_contribution", "signature"),
    "meshkit.train._worker.node_job": ("node_attack", "serve_train_job"),
    "meshkit.train._worker.secure": ("Signing",),
    "meshkit.train._partitions": ("Partition", "WorkerIdentity", "order_partitions"),
    "meshkit.train._coordinator.launch": ("free_ports",),
    "meshkit.train._pool": ("GroupPool", "LocalPool", "Reply", "WorkerPool", "broadcast", "call"),
    "meshkit.train._coordinator.progress": (
        "format_event", "format_metrics", "format_result", "format_round",
    ),
    "meshkit.train._protocol": ("TAG_REPLY", "TAG_REQUEST", "decode", "encode"),
    "meshkit.train._rounds.skeleton": ("RoundOutcome", "run_rounds", "timed"),
    "meshkit.train._traits": ("StrategyTraits", "strategy_traits"),
    "meshkit.train._coordinator.preflight": ("build_components",),
    "meshkit.train._coordinator.plan": ("Plan", "check", "resolve"),
    "meshkit.train._coordinator.report": ("Interrupted", "RunEvent", "RunReport"),
    "meshkit.train._coordinator.runner": ("Runner", "load_run_config", "run"),
    "meshkit.train._sharding": (
        "client_seed", "cohort_size", "poisson_clients", "sample_clients", "shard_bounds",
        "shard_pair",
    ),
    "meshkit.train._strategy": (
        "RoundReport", "RunStopped", "Strategy", "StrategyContext", "StrategyResult",
        "weighted_mean",
    ),
    "meshkit.train._worker.trainer": ("Trainer", "serve_trainer", "with_device"),
    "meshkit.train._worker.local_sgd": (
        "apply_update", "decode_update", "outer_update", "pseudo_gradients", "split_fragments",
        "state_digest",
    ),
    "meshkit.train._rounds.secure": ("SecureSum", "round_params", "secure_sum"),
}

_WHERE: dict[str, str] = {name: module for module, names in _MODULES.items() for name in names}

__all__ = [
    # the strategy contract
    "Strategy",
    "StrategyContext",
    "StrategyResult",
    "StrategyTraits",
    "strategy_traits",
    "RoundReport",
    "RunStopped",
    "weighted_mean",
    # the round skeleton
    "run_rounds",
    "RoundOutcome",
    "timed",
    # the round engine
    "fold_round",
    "Work",
    "Folded",
    "by_examples",
    "once",
    "train_loss",
    "DEFAULT_WINDOW",
    "HOLD",
    "INLINE_BYTES",
    "answer_relay_request",
    # host relays: the relay's side (a transport offering relays carries the bytes)
    "RelayPool",
    "RelayRanks",
    "FoldRequest",
    "FanoutRequest",
    "parse_relay_request",
    # sharding and sampling
    "shard_bounds",
    "shard_pair",
    "client_seed",
    "sample_clients",
    "cohort_size",
    "poisson_clients",
    # model-parallel partitions
    "Partition",
    "WorkerIdentity",
    "order_partitions",
    # reaching workers
    "Reply",
    "WorkerPool",
    "LocalPool",
    "GroupPool",
    "call",
    "broadcast",
    "with_device",
    # the trainer protocol and the worker side
    "TAG_REQUEST",
    "TAG_REPLY",
    "encode",
    "decode",
    "Trainer",
    "serve_trainer",
    "serve_train_job",
    "node_attack",
    "Signing",
    # simulated attacks
    "AttackPlan",
    "AttackedFold",
    # running a job
    "RunReport",
    "RunEvent",
    "Runner",
    "Interrupted",
    "run",
    "load_run_config",
    "build_components",
    # a config resolved against the plugins (was meshkit.config's before issue 33)
    "Plan",
    "resolve",
    "check",
    "METRICS_NAME",
    "REPORT_NAME",
    "read_metrics",
    # keys kept on each client (FedBN)
    "ClientLocal",
    "resolve_local_keys",
    "Trainable",
    "Broadcast",
    # progress lines, as the CLI prints them
    "format_event",
    "format_metrics",
    "format_round",
    "format_result",
    # the message boundary (meshkit/train/_messages.py)
    "check_contribution",
    "signature",
    # member failures: a rank for the round, a client's own, quarantine (_failures.py)
    "RoundFailures",
    "DivergedFit",
    "reply_failure",
    "strike",
    "QUARANTINE_AFTER",
    # local launches
    "free_ports",
    # collective runs: every rank plays its slice of the round (meshkit/train/_rounds/collective.py)
    "PartialReducer",
    "cohort_slice",
    "check_collective",
    # local SGD (DiLoCo): the arithmetic coordinator and replicas share (_worker/local_sgd.py)
    "split_fragments",
    "state_digest",
    "apply_update",
    "decode_update",
    "pseudo_gradients",
    "outer_update",
    # secure aggregation ([secure_aggregation], meshkit/train/_rounds/secure.py)
    "secure_sum",
    "SecureSum",
    "round_params",
]


if not TYPE_CHECKING:  # the type checker reads the imports above instead
    __getattr__, __dir__ = on_first_use(__name__, _WHERE, globals())
