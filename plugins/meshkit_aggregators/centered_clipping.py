"""``centered-clipping``: iterative clipping around a centre carried across rounds
(Karimireddy, He, Jaggi, *Learning from History for Byzantine Robust Optimization*,
ICML 2021).

On updates ``d_i = contribution_i - reference`` (the round's global model;
without one the contributions are taken as updates), from the centre
``v`` the previous round ended with (zeros in the first round)::

    repeat iterations times:  v <- v + (1/n) sum_i clip_tau(d_i - v)
    result = reference + v

where ``clip_tau(u) = u * min(1, tau / ||u||)`` over the whole update
(:func:`meshkit.aggregation.clip_update`'s rule). Each contributor counts
once (the paper's mean). Defaults: ``tau = 1.0``, ``iterations = 1`` (the
paper's single clipping step per round, its momentum carried by the
centre). The centre is the rule's state: ``state_dict()`` holds it, the run
checkpoints it beside the outer optimizer's state each round, and
``--resume`` restores it (``load_state_dict``), so a resumed run clips
around the same centre it would have.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from meshkit import AggregationError
from meshkit.aggregation import AggregatorTraits

from meshkit_aggregators._distances import distances_to
from meshkit_aggregators.robust import RobustRule

__all__ = ["CenteredClipping"]


class CenteredClipping(RobustRule):
    """Clipped steps from the carried centre (see the module docstring)."""

    name = "centered-clipping"
    #: Steps from a centre it carries across rounds (checkpointed), on updates.
    traits = AggregatorTraits(uses_reference=True, stateful=True)

    def __init__(self, tau: float = 1.0, iterations: int = 1) -> None:
        if not tau > 0 or not np.isfinite(tau):
            raise ValueError(f"tau must be a finite number > 0, got {tau!r}")
        if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
            raise ValueError(f"iterations must be an integer >= 1, got {iterations!r}")
        self.tau, self.iterations = tau, iterations
        self._centre: np.ndarray | None = None

    def combine(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        v = np.zeros(x.shape[1]) if self._centre is None else self._centre.copy()
        if v.shape != (x.shape[1],):
            raise AggregationError(
                f"{self.name}: the carried centre has {v.size} coordinates but the "
                f"contributions have {x.shape[1]}; the model changed under a resumed run")
        for _ in range(self.iterations):
            u = x - v
            # Scale-safe: an update at 1e155 is clipped to tau, not zeroed by an inf norm.
            norms = distances_to(x, v)
            scale = np.minimum(1.0, self.tau / np.maximum(norms, np.finfo(np.float64).tiny))
            v = v + (u * scale[:, None]).mean(axis=0)
        self._centre = v
        return v

    def state_dict(self) -> dict[str, Any]:
        """The centre (float64, flattened over the model's float coordinates); {} before round 1."""
        return {} if self._centre is None else {"centre": self._centre.copy()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        centre = state.get("centre")
        if centre is None:
            self._centre = None
            return
        array = np.asarray(centre, dtype=np.float64)
        if array.ndim != 1 or not np.isfinite(array).all():
            raise AggregationError(f"{self.name}: the saved centre is not a finite vector")
        self._centre = array.copy()
