"""``[privacy] placement = "distributed"``: the clients add Skellam noise under secure aggregation.

The mechanism ``dp-fixed`` builds with that placement. The clients clip
their updates to S (``clip = "client"``), put them on the round's integer
grid with conditional randomised rounding and add their share of Skellam
noise in the secure aggregation's field before masking
(:mod:`meshkit.privacy`'s :class:`~meshkit.privacy.SkellamPlan`, run on the
worker); the coordinator unmasks a sum that already carries the noise and
releases ``global + sum / m`` (m the expected cohort, as the central
mechanism divides). It never adds noise and never sees a noiseless sum.

Accounting (:class:`~meshkit.privacy.SkellamAccountant`): before a round,
the ε it would bring the run to if every sampled client survives
(``target_epsilon`` stops the run there); after it, the round is composed
with the noise its *contributors* added (each added μ/n: fewer survivors,
less noise, a larger ε), and the round's own ε is reported with it.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import attrs
import numpy as np

from meshkit.privacy import SkellamAccountant, SkellamPlan, field_levels, plan_skellam

__all__ = ["DistributedSkellam"]


@attrs.define
class DistributedSkellam:
    """Distributed DP-FedAvg with Skellam noise from the clients (module docstring)."""

    clip_norm: float
    noise_multiplier: float
    delta: float = 1e-5
    target_epsilon: float = 0.0
    noise: str = "os"
    name: str = "dp-fixed"
    accountant: SkellamAccountant = attrs.field(default=None)
    #: Who clips: always the clients (the coordinator never holds an update).
    placement: str = "client"
    #: Who adds the noise (the strategy reads it to play the distributed round).
    noise_placement: str = "distributed"
    adaptive: Any = None
    #: The last planned round's grid and noise.
    plan: SkellamPlan | None = None

    def __attrs_post_init__(self) -> None:
        if self.accountant is None:
            self.accountant = SkellamAccountant(self.delta)

    def plan_round(self, *, cohort: int, length: int, bits: int,
                   population: int | None = None) -> SkellamPlan:
        """The round's grid and noise for ``cohort`` clients in a ``bits``-bit field; the grid
        planned for ``population`` clients (the run's), so that it is the same whoever was
        sampled (:func:`~meshkit.privacy.plan_skellam`)."""
        self.plan = plan_skellam(clip_norm=self.clip_norm,
                                 noise_multiplier=self.noise_multiplier, cohort=cohort,
                                 length=length, levels=field_levels(bits, cohort), bits=bits,
                                 population=population)
        return self.plan

    def _group(self, q: float, contributors: int | None = None
               ) -> tuple[float, float, float, float]:
        plan = self.plan
        if plan is None:
            # Before any round (meshkit check) the grid is unknown: the fine-grid limit,
            # Δ₂ = G, Δ₁ = G² and μ = (z·G)² for G = 2^20 (the ε the rounds then approach).
            grid = float(1 << 20)
            return (q, (self.noise_multiplier * grid) ** 2, grid, grid * grid)
        count = plan.cohort if contributors is None else contributors
        return (q, plan.sum_variance(count), plan.bound, plan.l1)

    def epsilon(self) -> float:
        return self.accountant.epsilon()

    def epsilon_after(self, q: float, rounds: int = 1) -> float:
        """ε after ``rounds`` more rounds in which every sampled client survives."""
        return self.accountant.epsilon(extra=[(*self._group(q), rounds)])

    def finish_round(self, q: float, contributors: int) -> dict[str, float]:
        """Compose the round with the noise its ``contributors`` added; its figures."""
        assert self.plan is not None  # plan_round came first
        group = self._group(q, contributors)
        self.accountant.compose(*group)
        plan = self.plan
        return {"epsilon": self.accountant.epsilon(),
                "round_epsilon": self.accountant.round_epsilon(*group),
                # The std of the sum's noise per coordinate, in units of the update.
                "noise_std": math.sqrt(group[1]) / plan.scale,
                "noise_multiplier_realized": math.sqrt(group[1]) / plan.bound}

    def release(self, state: Mapping[str, Any], summed: Mapping[str, np.ndarray],
                expected: float) -> dict[str, Any]:
        """The round's model: the global plus the noised sum over the expected cohort m."""
        out = dict(state)
        for key, total in summed.items():
            ref = np.asarray(state[key])
            out[key] = (ref.astype(np.float64) + total / expected).astype(ref.dtype)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"accountant": self.accountant.state_dict(), "clip_norm": self.clip_norm}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.accountant.load_state_dict(state["accountant"])
        self.clip_norm = float(state["clip_norm"])
