"""Options (the ``[privacy]`` keys) of the built-in privacy mechanisms: attrs only."""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["CommonOptions", "DpFixedOptions", "DpAdaptiveOptions"]

#: Mirrors meshkit.privacy (PLACEMENTS, ACCOUNTANTS, NOISE_SOURCES); kept here so
#: listing plugins never imports numpy.
_PLACEMENTS = ("coordinator", "client")
_ACCOUNTANTS = ("pld", "rdp")
_NOISE = ("os", "seeded")


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not value > 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value}")


def _not_negative(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not value >= 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")


def _probability(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not 0.0 < value < 1.0:
        raise ValueError(f"{attribute.name} must be in (0, 1), got {value}")


def _one_of(*choices: str) -> Any:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value not in choices:
            raise ValueError(f"{attribute.name} must be one of "
                             + ", ".join(repr(c) for c in choices) + f"; got {value!r}")
    return check


@attrs.frozen
class CommonOptions:
    """The ``[privacy]`` keys every built-in mechanism takes."""

    #: Who clips: the coordinator, or each client before it replies (the
    #: coordinator then never sees an unclipped update).
    clip: str = attrs.field(default="coordinator", validator=_one_of(*_PLACEMENTS), kw_only=True)
    delta: float = attrs.field(default=1e-5, validator=_probability, kw_only=True)
    #: Stop the run before the round that would take ε past this (0: no budget).
    target_epsilon: float = attrs.field(default=0.0, validator=_not_negative, kw_only=True)
    accountant: str = attrs.field(default="pld", validator=_one_of(*_ACCOUNTANTS), kw_only=True)
    #: "os": fresh OS entropy (the guarantee); "seeded": from (run seed, round),
    #: reproducible, and no privacy against whoever knows the seed (testing only).
    noise: str = attrs.field(default="os", validator=_one_of(*_NOISE), kw_only=True)


@attrs.frozen
class DpFixedOptions(CommonOptions):
    """``dp-fixed``: clip norm S and noise multiplier z (σ = z·S/m on the mean)."""

    clip_norm: float = attrs.field(default=1.0, validator=_positive)
    noise_multiplier: float = attrs.field(default=1.0, validator=_positive)


@attrs.frozen
class DpAdaptiveOptions(CommonOptions):
    """``dp-adaptive`` (Andrew et al. 2021): S follows the ``target_quantile`` of update norms.

    Defaults are the paper's: initial S 0.1, γ = 0.5, η = 0.2.
    ``count_noise_multiplier`` is the noise multiplier of the (centred) count
    of unclipped updates; the paper's σ_b = m/20 is ``count_noise_multiplier
    = m/10``.
    """

    initial_clip_norm: float = attrs.field(default=0.1, validator=_positive)
    target_quantile: float = attrs.field(default=0.5, validator=_probability)
    clip_lr: float = attrs.field(default=0.2, validator=_positive)
    noise_multiplier: float = attrs.field(default=1.0, validator=_positive)
    count_noise_multiplier: float = attrs.field(default=10.0, validator=_positive)
