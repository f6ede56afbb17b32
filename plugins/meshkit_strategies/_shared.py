"""What more than one built-in strategy needs: the round's training loss and the row count.

Neither is a round rule: :func:`train_loss` summarises the replies for the
round's report, and :func:`training_rows` is what the pre-run checks
compare client and worker counts against.
"""

from __future__ import annotations

from typing import Any, Sequence

from meshkit.train import weighted_mean


def train_loss(replies: Sequence[Any]) -> dict[str, float]:
    """The example-weighted mean of the replies' ``train_loss`` ({} when none reported one)."""
    loss = weighted_mean((r.payload["metrics"]["train_loss"], r.payload.get("examples", 1))
                         for r in replies if "train_loss" in r.payload.get("metrics", {}))
    return {} if loss is None else {"train_loss": loss}


def training_rows(task: Any) -> int | None:
    """How many training rows the coordinator's copy of the task has (None: unknown)."""
    data = getattr(task, "train_data", None)
    if not callable(data):
        return None
    x, _ = data()
    return len(x)
