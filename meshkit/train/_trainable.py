"""Send only what trains: ``[strategy] trainable = [...]`` and which workers hold the rest.

``trainable`` names the state keys that train (glob patterns, or a task's key
group such as ``meshkit.torch``'s ``"@lora"``): only those travel -- the
coordinator sends a worker the whole model once, and only the trainable keys
after that; a fit answers with only the trainable keys -- and only those are
aggregated and stepped. The frozen rest stays on each worker as the first
round sent it, and on the coordinator, whose checkpoint keeps the whole model.

Which workers hold the frozen keys is known here, on the coordinator: a rank
that was sent the whole model and has not failed since. A rank that died (and
may have come back as a fresh process) is sent the whole model again; a worker
told to merge trainable keys into a model it does not hold refuses (its reply
is an error, so the round counts it as a failed member and the next round
sends it everything).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import attrs

__all__ = ["Trainable"]


@attrs.define
class Trainable:
    """The run's trainable keys and the ranks that hold the frozen rest of the model."""

    keys: frozenset[str]
    #: Ranks sent the whole model (and not failed since).
    holders: set[int] = attrs.Factory(set)

    def of(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """``state``'s trainable keys: what travels and what is folded."""
        return {k: v for k, v in state.items() if k in self.keys}

    def set_state(self, rank: int, state: Mapping[str, Any]) -> dict[str, Any]:
        """The ``set_state`` request for ``rank``: the whole ``state`` the first time,
        its trainable keys after."""
        names = sorted(self.keys)
        if rank in self.holders:
            return {"op": "set_state", "state": self.of(state), "trainable": names}
        self.holders.add(rank)
        return {"op": "set_state", "state": dict(state), "trainable": names}

    def forget(self, ranks: Iterable[int]) -> None:
        """``ranks`` failed or died: send them the whole model next time."""
        self.holders.difference_update(ranks)

    def keep_only(self, live: Iterable[int]) -> None:
        """Forget every rank that is not live (it may come back as a fresh process)."""
        self.holders.intersection_update(live)
