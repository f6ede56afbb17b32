"""The Gaussian mechanism ``dp-fixed`` and ``dp-adaptive`` build (the contract is meshkit's).

A *privacy mechanism* (kind ``privacy``, ``[privacy]``;
:class:`meshkit.privacy.PrivacyMechanism`) turns a federated round into a
differentially private one. The strategy asks it, per round:

* :meth:`GaussianMechanism.epsilon_after` -- the ε the next round would
  bring the run to (before the round: ``target_epsilon`` stops the run
  there, cleanly);
* :meth:`GaussianMechanism.begin` -- the fold that clips, sums and noises
  the round's updates (:class:`meshkit_privacy.NoisedSum`);
* :meth:`GaussianMechanism.finish` -- after the fold: compose the round
  into the accountant and, for adaptive clipping, move the clip norm.

Its state (the accountant's history, the current clip norm) is
checkpointed with the run, so a resumed run reports the same ε and clips
with the same S.

Noise comes from the operating system's entropy by default (``noise =
"os"``). ``noise = "seeded"`` derives it from (run seed, round): a run is
then reproducible bit for bit, which tests and benchmarks need -- and the
noise is *known to anyone who knows the seed*, who can subtract it: a
seeded run has no privacy against them. Use it to test, never to protect.
"""

from __future__ import annotations

import math
import secrets
from typing import Any, Mapping

import attrs
import numpy as np

from meshkit.privacy import Accountant, common_noise_key, effective_noise_multiplier

from meshkit_privacy.noised_sum import NoisedSum

__all__ = ["GaussianMechanism", "AdaptiveClip", "noise_seed"]

#: Streams of one round's seeded randomness (noise on the sum, on the count).
_SUM, _COUNT = 0x5E55, 0xC0C0


def noise_seed(seed: int, round_: int, stream: int) -> np.random.SeedSequence:
    """The seeded noise of one round (``noise = "seeded"``): a function of (seed, round, stream)."""
    return np.random.SeedSequence([seed, round_, stream])


#: The most an adaptive clip norm's log moves in one round (the paper's steps are
#: η·|b̃ − γ| <= 0.2 or so; this only stops an overflow).
MAX_CLIP_STEP = 20.0
#: The range an adaptive clip norm is kept within.
CLIP_BOUNDS = (1e-12, 1e12)


@attrs.frozen
class AdaptiveClip:
    """Andrew et al. 2021, "Differentially private learning with adaptive clipping".

    After each round S ← S·exp(−η·(b̃ − γ)), where γ is ``target_quantile``,
    η ``clip_lr`` and b̃ the noised share of updates that were within S:
    b̃ = (Σ_i (b_i − ½) + N(0, σ_b²)) / m + ½, with σ_b = ``count_z``/2 (the
    centred count has sensitivity ½, so ``count_z`` is its noise
    multiplier). The round then releases two Gaussians, accounted together
    as one with multiplier (z⁻² + count_z⁻²)^−½ (the paper's Theorem 1).
    """

    target_quantile: float
    clip_lr: float
    count_z: float

    def next_clip(self, clip: float, unclipped: int, expected: float,
                  rng: np.random.Generator) -> float:
        noised = (unclipped - expected / 2 + rng.normal(0.0, self.count_z / 2)) / expected + 0.5
        # The paper's step, bounded (post-processing: the guarantee is unchanged):
        # at most a factor e^MAX_CLIP_STEP a round, and the norm kept within
        # CLIP_BOUNDS, so no count and no noise draw overflows it or makes it 0.
        step = max(-MAX_CLIP_STEP, min(MAX_CLIP_STEP,
                                       -self.clip_lr * (noised - self.target_quantile)))
        return float(min(max(clip * math.exp(step), CLIP_BOUNDS[0]), CLIP_BOUNDS[1]))


@attrs.define
class GaussianMechanism:
    """User-level DP-FedAvg with a Gaussian on the fixed-denominator sum (``dp-fixed``,
    ``dp-adaptive``): the noise on the mean is σ = z·S/m per coordinate."""

    clip_norm: float
    noise_multiplier: float
    placement: str = "coordinator"
    #: Who adds the noise: the coordinator, to the sum ("distributed" is DistributedSkellam).
    noise_placement: str = "central"
    delta: float = 1e-5
    #: Stop before the round that would take ε past this (0: no budget).
    target_epsilon: float = 0.0
    accountant: Accountant = attrs.field(default=None)
    noise: str = "os"
    adaptive: AdaptiveClip | None = None
    name: str = "privacy"

    def __attrs_post_init__(self) -> None:
        if self.accountant is None:
            self.accountant = Accountant("pld", self.delta)

    @property
    def accounted_noise_multiplier(self) -> float:
        """The z the accountant composes each round (the count's noise included)."""
        if self.adaptive is None:
            return self.noise_multiplier
        return effective_noise_multiplier(self.noise_multiplier, self.adaptive.count_z)

    def epsilon(self) -> float:
        return self.accountant.epsilon()

    def epsilon_after(self, q: float, rounds: int = 1) -> float:
        return self.accountant.epsilon(extra=[(q, self.accounted_noise_multiplier, rounds)])

    def _rng(self, seed: int, round_: int, stream: int) -> np.random.Generator:
        if self.noise == "seeded":
            return np.random.default_rng(noise_seed(seed, round_, stream))
        return np.random.default_rng(secrets.randbits(128))

    def begin(self, reference: Mapping[str, Any], *, expected: float, seed: int,
              round_: int) -> NoisedSum:
        # None unless the run is seeded and a paired benchmark set the common key.
        key = common_noise_key(self.noise)
        return NoisedSum(reference, clip_norm=self.clip_norm,
                         noise_std=self.noise_multiplier * self.clip_norm,
                         expected=expected, rng=self._rng(seed, round_, _SUM),
                         clipped_by_clients=self.placement == "client", name=self.name,
                         common=None if key is None else (key, round_))

    def finish(self, fold: NoisedSum, q: float, *, unclipped: int | None = None,
               seed: int = 0, round_: int = 0) -> None:
        """Account the round; with adaptive clipping, move S for the next one."""
        self.accountant.compose(q, self.accounted_noise_multiplier)
        if self.adaptive is not None:
            count = fold.unclipped if unclipped is None else unclipped
            self.clip_norm = self.adaptive.next_clip(self.clip_norm, count, fold.expected,
                                                     self._rng(seed, round_, _COUNT))

    def state_dict(self) -> dict[str, Any]:
        return {"accountant": self.accountant.state_dict(), "clip_norm": self.clip_norm}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.accountant.load_state_dict(state["accountant"])
        self.clip_norm = float(state["clip_norm"])
