"""Options of the robust built-in aggregators (the ``[aggregator]`` keys; attrs only, cheap)."""

from __future__ import annotations

from typing import Any

import attrs

from meshkit.options import count_at_least, finite_positive

__all__ = ["TrimmedMeanOptions", "KrumOptions", "MultiKrumOptions", "BulyanOptions",
           "GeometricMedianOptions", "CenteredClippingOptions", "NormBoundOptions"]

#: ``f`` and ``m``: integers >= 0; iteration counts: >= 1.
_count = count_at_least(0)
_at_least_one = count_at_least(1)


def _multi_krum_f(instance: Any, attribute: Any, value: Any) -> None:
    _count(instance, attribute, value)
    # f = 0 with m = 0 keeps all n contributions: the weighted mean, fedavg under
    # another name -- the defence a config asked for would silently not be there.
    if value == 0 and instance.m == 0:
        raise ValueError("f must be at least 1 when m = 0: f = 0 and m = 0 average every "
                         "contribution, which is plain fedavg. Set f to the attackers a round "
                         "may hold (needs n >= 2f + 3; with [attack], its attacker count), or "
                         "m to the contributions to average")


def _bulyan_f(instance: Any, attribute: Any, value: Any) -> None:
    _count(instance, attribute, value)
    if value == 0:
        raise ValueError("f must be at least 1: with f = 0 bulyan keeps every contribution "
                         "and averages them all, the plain mean. Set f to the attackers a "
                         "round may hold (needs n >= 4f + 3; with [attack], its attacker "
                         "count)")


def _beta(instance: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 0.5:
        raise ValueError(f"beta (the fraction cut from each end) must be in [0, 0.5), got "
                         f"{value!r}")


@attrs.frozen
class TrimmedMeanOptions:
    """``trimmed-mean``: cut ``floor(beta * n)`` values from each end of every coordinate."""

    beta: float = attrs.field(default=0.2, validator=_beta)


@attrs.frozen
class KrumOptions:
    """``krum``: ``f``, the Byzantine contributors tolerated (needs n >= 2f + 3)."""

    f: int = attrs.field(default=0, validator=_count)


@attrs.frozen
class MultiKrumOptions:
    """``multi-krum``: ``f`` as Krum; ``m`` contributions averaged (0: n - f).

    ``f = 0`` with ``m = 0`` is refused: it keeps every contribution (fedavg).
    """

    f: int = attrs.field(default=0, validator=_multi_krum_f)
    m: int = attrs.field(default=0, validator=_count)


@attrs.frozen
class BulyanOptions:
    """``bulyan``: ``f``, the Byzantine contributors tolerated (needs n >= 4f + 3).

    ``f = 0`` is refused: Bulyan then keeps and averages every contribution.
    """

    f: int = attrs.field(default=0, validator=_bulyan_f)


@attrs.frozen
class GeometricMedianOptions:
    """``geometric-median``: Weiszfeld tolerance, iteration cap, smoothing.

    There is no weighting option: each contributor counts once, whatever
    example count it claims (a claim of 2^53 examples must not buy the
    round; docs/robustness.md, "Robust at every magnitude").
    """

    eps: float = attrs.field(default=1e-6, validator=finite_positive)
    max_iter: int = attrs.field(default=100, validator=_at_least_one)
    nu: float = attrs.field(default=1e-6, validator=finite_positive)


@attrs.frozen
class CenteredClippingOptions:
    """``centered-clipping``: clipping radius ``tau`` and clipping steps per round."""

    tau: float = attrs.field(default=1.0, validator=finite_positive)
    iterations: int = attrs.field(default=1, validator=_at_least_one)


@attrs.frozen
class NormBoundOptions:
    """``norm-bound``: every update clipped to L2 norm ``max_norm`` (required)."""

    max_norm: float = attrs.field(validator=finite_positive)
