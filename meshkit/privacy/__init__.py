"""Differential privacy for federated rounds: the mechanism's contract, its noised sum, the accountant.

A ``[privacy]`` table selects a mechanism (kind ``privacy``, hook
``meshkit_privacy()``; built-ins ``dp-fixed`` and ``dp-adaptive`` in the
``meshkit_privacy`` plugin). What lives where:

* ``_mechanism.py``: :class:`PrivacyMechanism` (what a strategy drives) and
  :class:`GaussianMechanism`, user-level DP-FedAvg with fixed or adaptive
  clipping, the one both built-ins build;
* ``_sum.py``: :class:`NoisedSum`, the fold that clips, sums, noises once
  and divides by the fixed expected cohort size;
* ``_accountant.py``: :class:`Accountant`, ε at δ of the Poisson-subsampled
  Gaussian by PLD (default) or RDP.

docs/privacy.md says what the guarantee covers and what it does not.
"""

from __future__ import annotations

from meshkit.privacy._accountant import (ACCOUNTANTS, RDP_ORDERS, Accountant,
                                         effective_noise_multiplier, epsilon_pld, epsilon_rdp)
from meshkit.privacy._mechanism import (NOISE_SOURCES, PLACEMENTS, AdaptiveClip,
                                        GaussianMechanism, PrivacyMechanism, noise_seed)
from meshkit.privacy._sum import NoisedSum, clip_contribution, float_keys

__all__ = ["ACCOUNTANTS", "RDP_ORDERS", "Accountant", "effective_noise_multiplier",
           "epsilon_pld", "epsilon_rdp", "NOISE_SOURCES", "PLACEMENTS", "AdaptiveClip",
           "GaussianMechanism", "PrivacyMechanism", "noise_seed", "NoisedSum", "float_keys",
           "clip_contribution"]
