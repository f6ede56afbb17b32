"""What more than one built-in strategy needs: the training set's row count.

Not a round rule: :func:`training_rows` is what the pre-run checks compare
client and worker counts against.
"""

from __future__ import annotations

from typing import Any


def training_rows(task: Any) -> int | None:
    """How many training rows the coordinator's copy of the task has (None: unknown)."""
    data = getattr(task, "train_data", None)
    if not callable(data):
        return None
    x, _ = data()
    return len(x)
