"""What more than one built-in strategy needs: the training set's row count, the served check.

:func:`training_rows` is what the pre-run checks compare client and worker
counts against (:func:`require_rows` the check itself, and
:func:`require_replica_task` the replicas' one: ``data-parallel`` and
``diloco``); :func:`require_served` is the ``min_clients`` rule a federated
round (private or not) applies after folding.
"""

from __future__ import annotations

from typing import Any, Sequence

from meshkit import ConfigError, MeshError
from meshkit.population import is_population


def require_served(rnd: int, folded: Any, sampled: Sequence[int], min_clients: int,
                   advice: str) -> None:
    """Stop the run when fewer clients were served than ``min_clients`` (at most those sampled);
    ``advice`` (:meth:`meshkit.train.StrategyContext.resume_advice`) says what to do then.

    min_clients counts served clients, not workers: one live worker may
    serve every client of a round.
    """
    if len(folded.served) >= min(min_clients, len(sampled)):
        return
    missing = "; ".join(f"client {c}: {why}" for c, why in folded.not_served.items())
    raise MeshError(
        f"round {rnd}: {len(folded.served)} of {len(sampled)} clients served, fewer than "
        f"min_clients = {min_clients} (not served: {missing or 'none'}). {advice}")


def require_replica_task(task: Any, workers: int, strategy: str, steps: str) -> None:
    """Refuse a task that cannot be a replica of ``strategy`` (``data-parallel``, ``diloco``):
    one without ``gradients()`` and ``apply()`` (``steps`` says what they are for), or with
    fewer training rows than ``workers`` (every replica trains on a shard of them)."""
    for method in ("gradients", "apply"):
        if not callable(getattr(task, method, None)):
            raise ConfigError(f"{strategy} needs the task to offer {method}() ({steps})")
    rows = training_rows(task)
    if rows is not None and rows < workers:
        raise ConfigError(
            f"{strategy} shards the task's {rows} training rows over {workers} workers; "
            f"every replica needs at least one row. Use at most {rows} workers")


def training_rows(task: Any) -> int | None:
    """How many training rows the coordinator's copy of the task has (None: unknown)."""
    data = getattr(task, "train_data", None)
    if not callable(data):
        return None
    x, _ = data()
    return len(x)


def require_rows(task: Any, clients: int) -> None:
    """Refuse more clients than the coordinator's task has training rows (one row each at least).

    A population makes each client's rows on demand: there is no set to split.
    """
    if is_population(task):
        return
    rows = training_rows(task)
    if rows is not None and rows < clients:
        raise ConfigError(
            f"[strategy] clients = {clients} but the task has only {rows} training rows; "
            f"every client's shard needs at least one row. Use at most {rows} clients")
