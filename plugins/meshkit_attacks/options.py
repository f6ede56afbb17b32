"""Options of the built-in attacks (the ``[attack]`` / ``--attack-option`` keys; attrs only)."""

from __future__ import annotations

import attrs

from meshkit.options import finite, finite_non_negative, finite_positive

__all__ = ["SignFlipOptions", "FactorOptions", "GaussianOptions", "IpmOptions", "AlieOptions",
           "SameValueOptions"]


@attrs.frozen
class SignFlipOptions:
    """``sign-flip``: the update sent is ``-factor * d``."""

    factor: float = attrs.field(default=1.0, validator=finite_positive)


@attrs.frozen
class FactorOptions:
    """``scale``: the update sent is ``factor * d``."""

    factor: float = attrs.field(default=10.0, validator=finite)


@attrs.frozen
class GaussianOptions:
    """``gaussian``: the update sent is ``N(0, sigma^2)`` per coordinate."""

    sigma: float = attrs.field(default=1.0, validator=finite_positive)


@attrs.frozen
class IpmOptions:
    """``ipm``: the update sent is ``-epsilon`` times the honest mean."""

    epsilon: float = attrs.field(default=0.1, validator=finite_positive)


@attrs.frozen
class AlieOptions:
    """``alie``: ``z`` standard deviations from the honest mean (0: Baruch et al.'s z_max)."""

    z: float = attrs.field(default=0.0, validator=finite_non_negative)


@attrs.frozen
class SameValueOptions:
    """``same-value``: every coordinate of the update sent is ``value``."""

    value: float = attrs.field(default=100.0, validator=finite)
