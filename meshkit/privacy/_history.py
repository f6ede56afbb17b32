"""What both accountants share: the rounds composed so far, checkpointed as they are.

:class:`~meshkit.privacy.Accountant` (the Gaussian's, rows ``[q, z, rounds]``) and
:class:`~meshkit.privacy.SkellamAccountant` (rows ``[q, mu, l2, l1, rounds]``) are
each a pure function of ``method``, ``delta`` and ``history``; this mixin saves
and restores exactly that, and refuses a checkpoint of another method or δ.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import attrs

__all__ = ["RoundHistory", "check_delta"]


def check_delta(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    """attrs validator: δ in (0, 1)."""
    if not 0.0 < value < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {value}")


class RoundHistory:
    """Mixin of the accountants: ``history`` rows of floats ending in a count of rounds."""

    method: str
    delta: float
    history: list[list[float]]
    #: How many numbers one row holds (the last is the count of rounds).
    ROW: ClassVar[int]

    def state_dict(self) -> dict[str, Any]:
        return {"method": self.method, "delta": self.delta,
                "history": [list(g) for g in self.history]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("method") != self.method or state.get("delta") != self.delta:
            raise ValueError(
                f"the checkpoint's accountant is {state.get('method')!r} at delta = "
                f"{state.get('delta')}, this run's is {self.method!r} at {self.delta}")
        rows = [list(row) for row in state["history"]]
        if any(len(row) != self.ROW for row in rows):
            raise ValueError(f"the checkpoint's {self.method!r} history has rows of other than "
                             f"{self.ROW} numbers: {rows}")
        self.history = [[*map(float, row[:-1]), int(row[-1])] for row in rows]
