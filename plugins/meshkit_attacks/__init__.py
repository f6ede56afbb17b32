"""Built-in attacks, to test a defence: how a Byzantine client poisons its contribution.

Model poisoning, on the client's update ``d = contribution - global``:
``sign-flip`` (``-factor * d``), ``scale`` (``factor * d``), ``gaussian``
(``d`` replaced by ``N(0, sigma^2)`` noise), ``same-value`` (every
coordinate ``value``), and the omniscient ``ipm`` (``-epsilon`` times the
honest mean) and ``alie`` (honest mean minus ``z`` honest standard
deviations); data poisoning: ``label-flip`` (label ``y`` trained as
``C - 1 - y``). Each module cites its paper and states its defaults.

Only records and options classes are declared here; numpy loads when an
attack is built, so listing plugins stays fast.
"""

from __future__ import annotations

from typing import Any, Iterable

import meshkit

from meshkit_attacks.options import (AlieOptions, FactorOptions, GaussianOptions, IpmOptions,
                                     SameValueOptions, SignFlipOptions)


def _sign_flip(options: SignFlipOptions) -> Any:
    from meshkit_attacks.sign_flip import SignFlip

    return SignFlip(factor=options.factor)


def _scale(options: FactorOptions) -> Any:
    from meshkit_attacks.scale import Scale

    return Scale(factor=options.factor)


def _gaussian(options: GaussianOptions) -> Any:
    from meshkit_attacks.gaussian import Gaussian

    return Gaussian(sigma=options.sigma)


def _label_flip() -> Any:
    from meshkit_attacks.label_flip import LabelFlip

    return LabelFlip()


def _ipm(options: IpmOptions) -> Any:
    from meshkit_attacks.ipm import InnerProductManipulation

    return InnerProductManipulation(epsilon=options.epsilon)


def _alie(options: AlieOptions) -> Any:
    from meshkit_attacks.alie import ALittleIsEnough

    return ALittleIsEnough(z=options.z)


def _same_value(options: SameValueOptions) -> Any:
    from meshkit_attacks.same_value import SameValue

    return SameValue(value=options.value)


@meshkit.hookimpl
def meshkit_attacks() -> Iterable[meshkit.Component]:
    return [
        meshkit.Component("sign-flip", _sign_flip, SignFlipOptions,
                          summary="sends -factor x its update (factor = 1)"),
        meshkit.Component("scale", _scale, FactorOptions,
                          summary="sends factor x its update (factor = 10; model boosting)"),
        meshkit.Component("gaussian", _gaussian, GaussianOptions,
                          summary="sends N(0, sigma^2) noise as its update (sigma = 1)"),
        meshkit.Component("label-flip", _label_flip,
                          summary="trains on flipped labels: y -> C - 1 - y"),
        meshkit.Component("ipm", _ipm, IpmOptions,
                          summary="omniscient: sends -epsilon x the honest mean update "
                                  "(epsilon = 0.1; simulation only)"),
        meshkit.Component("alie", _alie, AlieOptions,
                          summary="omniscient: honest mean - z x honest std (z from n and f; "
                                  "simulation only)"),
        meshkit.Component("same-value", _same_value, SameValueOptions,
                          summary="every coordinate of its update set to value (100)"),
    ]
