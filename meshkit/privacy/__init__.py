"""Differential privacy for federated rounds: the mechanism's contract, the accountant, client clipping.

A ``[privacy]`` table selects a mechanism (kind ``privacy``, hook
``meshkit_privacy()``). The kernel keeps what every mechanism is driven by
and accounted with; the mechanisms are plugins (the built-ins ``dp-fixed``
and ``dp-adaptive`` in the ``meshkit_privacy`` package: its
``GaussianMechanism``, ``AdaptiveClip``, ``NoisedSum`` and ``noise_seed``).
What lives where:

* ``_contract.py``: :class:`PrivacyMechanism` (what a strategy drives) and
  :class:`PrivacyFold` (the round's clip-sum-noise fold it begins);
  :data:`PLACEMENTS`, :data:`NOISE_SOURCES`;
* ``_accountant.py``: :class:`Accountant`, ε at δ of the Poisson-subsampled
  Gaussian by PLD (default) or RDP;
* ``_clip.py``: what DP releases (:func:`float_keys`) and a client's
  clipping of its own update (:func:`clip_contribution`, run on the worker);
* ``_skellam.py``: ``placement = "distributed"``: a client's share of the
  Skellam mechanism in the secure aggregation's field (:func:`plan_skellam`,
  :class:`SkellamPlan`: conditional rounding, Skellam noise, the field check);
* ``_skellam_accountant.py``: :class:`SkellamAccountant`, ε of the Skellam
  mechanism by RDP, each round with the noise its survivors added;
* ``_history.py``: what both accountants share, their checkpointed history
  of rounds (``state_dict``/``load_state_dict``) and the check of δ;
* ``_clipped.py``: :class:`ClippedSum`, the exact sum of clipped updates a
  round releases, the same bits folded on the coordinator or per worker
  (:func:`clip_bits`, :func:`one_bit`);
* ``_common_noise.py``: a benchmarking aid, never a privacy setting: a seeded
  run's central and distributed noise from the same draws while
  ``MESHKIT_BENCH_COMMON_NOISE`` is set (:func:`common_noise_key`), so that a
  paired benchmark compares the mechanisms, not two noise draws.

docs/privacy.md says what the guarantee covers and what it does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshkit._lazy import on_first_use

if TYPE_CHECKING:
    from meshkit.privacy._accountant import (ACCOUNTANTS, RDP_ORDERS, Accountant,
                                             effective_noise_multiplier, epsilon_pld, epsilon_rdp)
    from meshkit.privacy._clip import clip_contribution, float_keys
    from meshkit.privacy._clipped import COHORT_BITS, ClippedSum, clip_bits, one_bit
    from meshkit.privacy._skellam import (SkellamPlan, field_levels, l1_bound, plan_skellam,
                                          rounded_l2_bound, skellam_noise)
    from meshkit.privacy._skellam_accountant import (SKELLAM_ORDERS, SkellamAccountant,
                                                     epsilon_skellam, skellam_rdp, subsampled_rdp)
    from meshkit.privacy._common_noise import (COMMON_NOISE_ENV, common_noise_key,
                                                common_normal, common_skellam, common_uniforms)
    from meshkit.privacy._contract import (DISTRIBUTED, NOISE_SOURCES, PLACEMENTS, PrivacyFold,
                                           PrivacyMechanism)

#: Where each public name lives, imported on first use (a client that clips or adds no
#: noise never needs the accountants; every process a run starts paid for all of it:
#: docs/benchmarks.md, "ci2"). The imports above are the same names for the type
#: checker (tests/kernel/test_lazy_imports.py keeps the two in step).
_WHERE: dict[str, str] = {
    "ACCOUNTANTS": "meshkit.privacy._accountant",
    "RDP_ORDERS": "meshkit.privacy._accountant",
    "Accountant": "meshkit.privacy._accountant",
    "effective_noise_multiplier": "meshkit.privacy._accountant",
    "epsilon_pld": "meshkit.privacy._accountant",
    "epsilon_rdp": "meshkit.privacy._accountant",
    "clip_contribution": "meshkit.privacy._clip",
    "float_keys": "meshkit.privacy._clip",
    "COHORT_BITS": "meshkit.privacy._clipped",
    "ClippedSum": "meshkit.privacy._clipped",
    "clip_bits": "meshkit.privacy._clipped",
    "one_bit": "meshkit.privacy._clipped",
    "SkellamPlan": "meshkit.privacy._skellam",
    "field_levels": "meshkit.privacy._skellam",
    "l1_bound": "meshkit.privacy._skellam",
    "plan_skellam": "meshkit.privacy._skellam",
    "rounded_l2_bound": "meshkit.privacy._skellam",
    "skellam_noise": "meshkit.privacy._skellam",
    "SKELLAM_ORDERS": "meshkit.privacy._skellam_accountant",
    "SkellamAccountant": "meshkit.privacy._skellam_accountant",
    "epsilon_skellam": "meshkit.privacy._skellam_accountant",
    "skellam_rdp": "meshkit.privacy._skellam_accountant",
    "subsampled_rdp": "meshkit.privacy._skellam_accountant",
    "COMMON_NOISE_ENV": "meshkit.privacy._common_noise",
    "common_noise_key": "meshkit.privacy._common_noise",
    "common_normal": "meshkit.privacy._common_noise",
    "common_skellam": "meshkit.privacy._common_noise",
    "common_uniforms": "meshkit.privacy._common_noise",
    "DISTRIBUTED": "meshkit.privacy._contract",
    "NOISE_SOURCES": "meshkit.privacy._contract",
    "PLACEMENTS": "meshkit.privacy._contract",
    "PrivacyFold": "meshkit.privacy._contract",
    "PrivacyMechanism": "meshkit.privacy._contract",
}

__all__ = ["ACCOUNTANTS", "RDP_ORDERS", "Accountant", "effective_noise_multiplier",
           "epsilon_pld", "epsilon_rdp", "NOISE_SOURCES", "PLACEMENTS", "PrivacyMechanism",
           "PrivacyFold", "float_keys", "clip_contribution", "ClippedSum", "clip_bits",
           "one_bit", "COHORT_BITS", "SkellamPlan", "plan_skellam", "field_levels",
           "rounded_l2_bound", "l1_bound", "skellam_noise", "SkellamAccountant",
           "epsilon_skellam", "skellam_rdp", "subsampled_rdp", "SKELLAM_ORDERS",
           "DISTRIBUTED", "COMMON_NOISE_ENV", "common_noise_key", "common_normal",
           "common_skellam", "common_uniforms"]


if not TYPE_CHECKING:  # the type checker reads the imports above instead
    __getattr__, __dir__ = on_first_use(__name__, _WHERE, globals())
