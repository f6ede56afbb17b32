"""Built-in privacy mechanisms: ``dp-fixed`` and ``dp-adaptive`` (user-level DP-FedAvg).

Written as a third-party plugin would be, against meshkit's contract and
accountant (:mod:`meshkit.privacy`): records and options here; the mechanism
(numpy) in ``mechanism.py`` (:class:`GaussianMechanism`, :class:`AdaptiveClip`,
:func:`noise_seed`) and its fold in ``noised_sum.py`` (:class:`NoisedSum`),
imported when a factory builds one (or one of those names is first read), so
listing plugins stays fast. docs/privacy.md is the user's guide.
"""

from __future__ import annotations

import importlib
from typing import Any, Iterable

import meshkit

from meshkit_privacy.options import DpAdaptiveOptions, DpFixedOptions

__all__ = ["GaussianMechanism", "DistributedSkellam", "AdaptiveClip", "NoisedSum", "noise_seed",
           "dp_fixed", "dp_adaptive", "meshkit_privacy"]

#: The mechanism's public names, imported on first use (they pull in numpy).
_LAZY = {"GaussianMechanism": "meshkit_privacy.mechanism",
         "DistributedSkellam": "meshkit_privacy.distributed",
         "AdaptiveClip": "meshkit_privacy.mechanism",
         "noise_seed": "meshkit_privacy.mechanism",
         "NoisedSum": "meshkit_privacy.noised_sum"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'meshkit_privacy' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def _refuse_accountant(options: Any, name: str) -> None:
    """An ``accountant`` that cannot account the placement's noise is refused, never ignored."""
    distributed = options.placement == "distributed"
    wrong = (options.accountant not in (None, "skellam") if distributed
             else options.accountant == "skellam")
    if wrong:
        raise meshkit.RefusedError(
            f"[privacy] name = {name!r} with placement = {options.placement!r} and accountant "
            f"= {options.accountant!r}: "
            + ("the clients add Skellam noise, which only accountant = \"skellam\" accounts "
               "(\"pld\" and \"rdp\" account the Gaussian the coordinator adds). Use "
               "accountant = \"skellam\" or leave accountant out"
               if distributed else
               "the coordinator adds Gaussian noise, which \"skellam\" does not account. "
               "Use accountant = \"pld\" or \"rdp\", or placement = \"distributed\""))


def dp_fixed(options: DpFixedOptions) -> Any:
    """McMahan et al. 2018: clip to ``clip_norm``, noise σ = z·S/m on the mean; with
    ``placement = "distributed"``, the clients' Skellam noise (Agarwal et al. 2021)."""
    from meshkit.privacy import Accountant

    _refuse_accountant(options, "dp-fixed")
    if options.placement == "distributed":
        from meshkit_privacy.distributed import DistributedSkellam

        return DistributedSkellam(
            clip_norm=options.clip_norm, noise_multiplier=options.noise_multiplier,
            delta=options.delta, target_epsilon=options.target_epsilon, noise=options.noise,
            name="dp-fixed", placement=options.clip)

    from meshkit_privacy.mechanism import GaussianMechanism

    return GaussianMechanism(
        clip_norm=options.clip_norm, noise_multiplier=options.noise_multiplier,
        placement=options.clip, delta=options.delta, target_epsilon=options.target_epsilon,
        accountant=Accountant(options.accountant_name, options.delta), noise=options.noise,
        name="dp-fixed")


def dp_adaptive(options: DpAdaptiveOptions) -> Any:
    """Andrew et al. 2021: S moves geometrically towards a quantile of the update norms."""
    from meshkit.privacy import Accountant

    from meshkit_privacy.mechanism import AdaptiveClip, GaussianMechanism

    if options.placement == "distributed":
        raise meshkit.RefusedError(
            "[privacy] name = \"dp-adaptive\" with placement = \"distributed\": adaptive "
            "clipping moves S by a noised count of the clients within it, and meshkit has no "
            "distributed noise for that count (each client's bit would reach the coordinator "
            "in clear). Use name = \"dp-fixed\" with placement = \"distributed\", or "
            "placement = \"central\"")
    _refuse_accountant(options, "dp-adaptive")

    return GaussianMechanism(
        clip_norm=options.initial_clip_norm, noise_multiplier=options.noise_multiplier,
        placement=options.clip, delta=options.delta, target_epsilon=options.target_epsilon,
        accountant=Accountant(options.accountant_name, options.delta), noise=options.noise,
        adaptive=AdaptiveClip(options.target_quantile, options.clip_lr,
                              options.count_noise_multiplier),
        name="dp-adaptive")


@meshkit.hookimpl
def meshkit_privacy() -> Iterable[meshkit.Component]:
    return [
        meshkit.Component("dp-fixed", dp_fixed, DpFixedOptions,
                          summary="user-level DP-FedAvg: clip to S, Gaussian noise z·S/m on "
                                  "the mean (McMahan et al. 2018)"),
        meshkit.Component("dp-adaptive", dp_adaptive, DpAdaptiveOptions,
                          summary="DP-FedAvg with S tracking a quantile of update norms "
                                  "(Andrew et al. 2021)"),
    ]
