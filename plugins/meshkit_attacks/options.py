"""Options of the built-in attacks (the ``[attack]`` / ``--attack-option`` keys; attrs only)."""

from __future__ import annotations

import math
from typing import Any

import attrs

__all__ = ["SignFlipOptions", "FactorOptions", "GaussianOptions", "IpmOptions", "AlieOptions",
           "SameValueOptions"]


def _finite(instance: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{attribute.name} must be a finite number, got {value!r}")


def _positive(instance: Any, attribute: Any, value: Any) -> None:
    _finite(instance, attribute, value)
    if not value > 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value!r}")


def _non_negative(instance: Any, attribute: Any, value: Any) -> None:
    _finite(instance, attribute, value)
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value!r}")


@attrs.frozen
class SignFlipOptions:
    """``sign-flip``: the update sent is ``-factor * d``."""

    factor: float = attrs.field(default=1.0, validator=_positive)


@attrs.frozen
class FactorOptions:
    """``scale``: the update sent is ``factor * d``."""

    factor: float = attrs.field(default=10.0, validator=_finite)


@attrs.frozen
class GaussianOptions:
    """``gaussian``: the update sent is ``N(0, sigma^2)`` per coordinate."""

    sigma: float = attrs.field(default=1.0, validator=_positive)


@attrs.frozen
class IpmOptions:
    """``ipm``: the update sent is ``-epsilon`` times the honest mean."""

    epsilon: float = attrs.field(default=0.1, validator=_positive)


@attrs.frozen
class AlieOptions:
    """``alie``: ``z`` standard deviations from the honest mean (0: Baruch et al.'s z_max)."""

    z: float = attrs.field(default=0.0, validator=_non_negative)


@attrs.frozen
class SameValueOptions:
    """``same-value``: every coordinate of the update sent is ``value``."""

    value: float = attrs.field(default=100.0, validator=_finite)
