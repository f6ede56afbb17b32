"""meshkit-robust: aggregators for a federation some contributors may poison.

Offers two aggregators, selectable by name in a config::

    [aggregator]
    name = "trimmed-mean"
    trim = 0.2

* ``median`` — the coordinate-wise (weighted) median;
* ``trimmed-mean`` — the coordinate-wise mean after cutting a fraction
  ``trim`` of the total weight from each end.

This module is what meshkit imports to list plugins, so it only declares
records and options; numpy loads when an aggregator is built.
"""

from __future__ import annotations

from typing import Any, Iterable

import attrs

import meshkit

__all__ = ["TrimmedMeanOptions", "meshkit_aggregators"]
__version__ = "0.1.0"


def _fraction_below_half(instance: Any, attribute: Any, value: float) -> None:
    # trim = 0.5 would cut every contribution; a negative trim is meaningless.
    if not 0.0 <= value < 0.5:
        raise ValueError(f"trim must be in [0, 0.5), the fraction of the total weight cut "
                         f"from each end; got {value!r}")


@attrs.frozen
class TrimmedMeanOptions:
    """The ``[aggregator]`` keys ``trimmed-mean`` accepts."""

    #: Fraction of the total weight cut from each end, coordinate by coordinate.
    trim: float = attrs.field(default=0.1, validator=_fraction_below_half)


def _median(options: Any = None) -> Any:
    from meshkit_robust.robust import CoordinateWise, weighted_median

    return CoordinateWise("median", weighted_median)


def _trimmed_mean(options: TrimmedMeanOptions) -> Any:
    from meshkit_robust.robust import CoordinateWise, weighted_trimmed_mean

    trim = options.trim
    return CoordinateWise("trimmed-mean",
                          lambda values, weights: weighted_trimmed_mean(values, weights, trim))


@meshkit.hookimpl
def meshkit_aggregators() -> Iterable[meshkit.Component]:
    return [
        meshkit.Component("median", _median,
                          summary="coordinate-wise weighted median (robust to a minority "
                                  "of poisoned contributions)"),
        meshkit.Component("trimmed-mean", _trimmed_mean, TrimmedMeanOptions,
                          summary="coordinate-wise mean after trimming `trim` of the weight "
                                  "from each end"),
    ]
