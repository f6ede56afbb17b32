"""Options (the ``[privacy]`` keys) of the built-in privacy mechanisms: attrs only."""

from __future__ import annotations

import math
from typing import Any

import attrs

__all__ = ["CommonOptions", "DpFixedOptions", "DpAdaptiveOptions"]

#: Mirrors meshkit.privacy (PLACEMENTS, ACCOUNTANTS, NOISE_SOURCES); kept here so
#: listing plugins never imports numpy.
_PLACEMENTS = ("coordinator", "client")
_ACCOUNTANTS = ("pld", "rdp", "skellam")
#: Mirrors meshkit.privacy.DISTRIBUTED: who adds the noise.
_NOISE_PLACEMENTS = ("central", "distributed")
_NOISE = ("os", "seeded")


def _probability(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not 0.0 < value < 1.0:
        raise ValueError(f"{attribute.name} must be in (0, 1), got {value}")


def _within(low: float, high: float, why: str) -> Any:
    """A finite number from ``low`` to ``high`` (both included); ``why`` says why the range."""
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not (math.isfinite(value) and low <= value <= high):
            raise ValueError(f"{attribute.name} must be a number from {low:g} to {high:g} "
                             f"({why}), got {value}")
    return check


#: The noise multipliers a privacy accountant composes (above 1e6 the noise is a
#: million clip norms). Below 1e-3 one round's ε is in the millions.
NOISE_RANGE = (1e-3, 1e6)
#: The PLD accountant's grid grows as 1/z² (at z = 1e-3 it would take terabytes):
#: it composes a round's noise multiplier (for dp-adaptive, the two combined) of
#: at least this; below, use ``accountant = "rdp"`` (or more noise).
PLD_MIN_NOISE = 0.1
#: delta below 1e-10 is past what the PLD accountant resolves (its tail cut-off
#: is 1e-15 a round, so ε reads infinite).
DELTA_RANGE = (1e-10, 0.5)
#: A clip norm (an update's L2 norm) meshkit can square and sum without overflow.
CLIP_RANGE = (1e-12, 1e12)


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
    delta: float = attrs.field(default=1e-5, validator=_within(
        *DELTA_RANGE, "the accountant's resolution; 1/clients or less is usual"), kw_only=True)
    #: Stop the run before the round that would take ε past this (0: no budget).
    target_epsilon: float = attrs.field(default=0.0, validator=_within(
        0.0, 1e6, "0: no budget"), kw_only=True)
    #: None: the placement's own ("pld" central, "skellam" distributed).
    accountant: str | None = attrs.field(default=None, validator=attrs.validators.optional(
        _one_of(*_ACCOUNTANTS)), kw_only=True)
    #: "central": the coordinator noises the sum; "distributed": each client adds its
    #: share of Skellam noise in the secure aggregation's field (needs [secure_aggregation]).
    placement: str = attrs.field(default="central", validator=_one_of(*_NOISE_PLACEMENTS),
                                 kw_only=True)

    @property
    def accountant_name(self) -> str:
        """The accountant the run uses: ``accountant``, or the placement's own."""
        if self.accountant is not None:
            return self.accountant
        return "skellam" if self.placement == "distributed" else "pld"
    #: "os": fresh OS entropy (the guarantee); "seeded": from (run seed, round),
    #: reproducible, and no privacy against whoever knows the seed (testing only).
    noise: str = attrs.field(default="os", validator=_one_of(*_NOISE), kw_only=True)


def _pld_resolves(options: Any, accounted: float) -> None:
    if options.accountant_name == "pld" and accounted < PLD_MIN_NOISE:
        raise ValueError(
            f"noise_multiplier must be at least {PLD_MIN_NOISE:g} for accountant = \"pld\" "
            f"(the round's accounted noise multiplier is {accounted:.3g}; the PLD grid grows "
            f"as its inverse square); raise the noise, or use accountant = \"rdp\"")


@attrs.frozen
class DpFixedOptions(CommonOptions):
    """``dp-fixed``: clip norm S and noise multiplier z (σ = z·S/m on the mean)."""

    clip_norm: float = attrs.field(default=1.0, validator=_within(*CLIP_RANGE, "an L2 norm"))
    noise_multiplier: float = attrs.field(default=1.0, validator=_within(
        *NOISE_RANGE, "what the accountant composes"))

    def __attrs_post_init__(self) -> None:
        _pld_resolves(self, self.noise_multiplier)


@attrs.frozen
class DpAdaptiveOptions(CommonOptions):
    """``dp-adaptive`` (Andrew et al. 2021): S follows the ``target_quantile`` of update norms.

    Defaults are the paper's: initial S 0.1, γ = 0.5, η = 0.2.
    ``count_noise_multiplier`` is the noise multiplier of the (centred) count
    of unclipped updates; the paper's σ_b = m/20 is ``count_noise_multiplier
    = m/10``.
    """

    initial_clip_norm: float = attrs.field(default=0.1, validator=_within(*CLIP_RANGE,
                                                                          "an L2 norm"))
    target_quantile: float = attrs.field(default=0.5, validator=_probability)
    #: η: the clip norm moves by at most a factor e^η a round.
    clip_lr: float = attrs.field(default=0.2, validator=_within(
        1e-6, 10.0, "the log-step of the clip norm a round"))
    noise_multiplier: float = attrs.field(default=1.0, validator=_within(
        *NOISE_RANGE, "what the accountant composes"))
    count_noise_multiplier: float = attrs.field(default=10.0, validator=_within(
        *NOISE_RANGE, "what the accountant composes"))

    def __attrs_post_init__(self) -> None:
        # The two Gaussians a round releases, accounted as one (Andrew et al., Theorem 1).
        _pld_resolves(self, (self.noise_multiplier ** -2
                             + self.count_noise_multiplier ** -2) ** -0.5)
