"""A round's vocabulary: the work it asks for, what comes back folded, and how a reply weighs.

Every round path (:data:`meshkit.train._rounds.engine.ROUND_PATHS`) takes
:class:`Work` and gives back a :class:`Folded`.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import attrs

from meshkit.train._rounds.skeleton import RoundOutcome
from meshkit.train._strategy import weighted_mean


__all__ = ["Work", "Folded", "by_examples", "once", "train_loss", "HOLD", "DEFAULT_WINDOW",
           "INLINE_BYTES"]


#: Whole contributions the coordinator holds by default (pulled or arriving,
#: not yet folded). One keeps the bound lowest: the round's global state, the
#: fold's accumulator, the one contribution the fold retains and the one
#: arriving (docs/strategies.md, "The round engine").
DEFAULT_WINDOW = 1

#: Bytes of results the flat round may hold beyond its window: a result this small
#: comes back with its fit instead of waiting on its worker for a ``take`` (one
#: message, not two), as many of them as fit in these bytes at once. Holding them on
#: the workers would save the coordinator less memory than its wire's own receive
#: buffers (4 MiB a link) and cost a round trip each; a model above it is pulled
#: through the window as before (docs/strategies.md, "The round engine").
INLINE_BYTES = 4 << 20

#: Results a worker keeps waiting for the coordinator to take before it is
#: handed more work: enough to fit the next client while the last waits.
HOLD = 2


@attrs.frozen
class Work:
    """One contribution a round asks for: its key (fold order) and the request.

    ``request`` is a ``fit`` or ``grads`` request without the global state
    (the engine sends that once per worker) and without ``keep`` (the engine
    adds it). ``rank`` pins the work to one worker: a client whose data only
    that node has (``[partitioner] name = "local"``). No other worker serves
    it; when that worker is lost, the key is not served this round.
    """

    key: int
    request: Mapping[str, Any]
    rank: int | None = None


def by_examples(reply: Mapping[str, Any]) -> float:
    """A contribution's weight: the examples it was trained on (realized work)."""
    return float(reply["examples"])


def once(reply: Mapping[str, Any]) -> float:
    """A contribution's weight when each counts the same (a data-parallel shard's
    gradient is already the mean over its batch: DDP's rule)."""
    return 1.0


def train_loss(replies: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """The example-weighted mean ``train_loss`` of small replies ({} when none had one)."""
    loss = weighted_mean((r["metrics"]["train_loss"], r.get("examples", 1))
                         for r in replies if "train_loss" in r.get("metrics", {}))
    return {} if loss is None else {"train_loss": loss}


@attrs.frozen
class Folded:
    """What :func:`fold_round` produced.

    ``result`` is the fold's result (None when nothing was served);
    ``served`` maps each folded key, in fold order, to the rank whose
    contribution was folded; ``not_served`` maps each key that could not be
    folded to the reason; ``replies`` holds each served key's small reply
    (``examples``, ``metrics``); ``late`` maps each key whose answer missed
    the round deadline to the rank that owed it (None: never handed out).
    """

    result: dict[str, Any] | None
    served: dict[int, int]
    not_served: dict[int, str]
    replies: dict[int, Mapping[str, Any]]
    late: dict[int, int | None] = attrs.Factory(dict)
    #: The folded keys whose contribution was attacked (``[attack]`` in simulation, or a
    #: node started with ``--attack`` that said so in its reply), ascending.
    attacked: tuple[int, ...] = ()
    #: Ranks dropped for the round for their own failure -> the reason
    #: (:mod:`meshkit.train._failures`); they are not dead.
    failed: dict[int, str] = attrs.Factory(dict)

    @property
    def answered(self) -> tuple[int, ...]:
        """The ranks that served at least one key, sorted."""
        return tuple(sorted(set(self.served.values())))

    @property
    def examples(self) -> int:
        return sum(int(r.get("examples", 0)) for r in self.replies.values())

    def train_loss(self) -> dict[str, float]:
        """The example-weighted mean of the served keys' ``train_loss`` ({} when none had one)."""
        return train_loss(self.replies.values())

    def outcome(self, state: Mapping[str, Any], metrics: Mapping[str, float],
                client_metrics: Mapping[int, Mapping[str, float]] | None = None) -> RoundOutcome:
        """The round's :class:`RoundOutcome`: ``state`` and ``metrics`` plus who served what
        (and ``client_metrics``, each client's evaluation, when there are any)."""
        return RoundOutcome(state, answered=self.answered, clients=tuple(self.served),
                            client_metrics={} if client_metrics is None else client_metrics,
                            examples=self.examples, metrics=dict(metrics),
                            served=dict(self.served), not_served=dict(self.not_served),
                            client_examples={k: int(self.replies[k].get("examples", 0))
                                             for k in self.served},
                            late=tuple(sorted({r for r in self.late.values()
                                               if r is not None})),
                            attacked=self.attacked, failed=dict(self.failed))
