"""meshkit-robust: bucketing, a robust aggregator meshkit's built-ins do not have.

Offers one aggregator, selectable by name in a config::

    [aggregator]
    name = "bucketing"
    bucket_size = 2
    inner = "median"

* ``bucketing`` — Karimireddy, He, Jaggi, *Byzantine-Robust Learning on
  Heterogeneous Datasets via Bucketing* (ICLR 2022): the round's
  contributions are shuffled into buckets of ``bucket_size``, each bucket is
  averaged (weighted by realized work), and another aggregator (``inner``,
  any registered name: the built-in ``median``, ``krum``, ...) combines the
  bucket means. Averaging first shrinks the spread honest but heterogeneous
  clients show, which is what robust rules mistake for attacks.

meshkit itself ships ``median`` and ``trimmed-mean`` (and Krum, Bulyan, ...);
this plugin composes with them rather than offering the same names, so
installing it never collides with a built-in.

This module is what meshkit imports to list plugins, so it only declares
records and options; numpy loads when an aggregator is built.
"""

from __future__ import annotations

from typing import Any, Iterable

import attrs

import meshkit

__all__ = ["BucketingOptions", "meshkit_aggregators"]
__version__ = "0.2.0"


def _bucket_size(instance: Any, attribute: Any, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"bucket_size must be an integer >= 1 (1: no bucketing), got "
                         f"{value!r}")


def _inner(instance: Any, attribute: Any, value: str) -> None:
    if not isinstance(value, str) or not value or value == "bucketing":
        raise ValueError(f"inner must name another aggregator (e.g. \"median\"), got "
                         f"{value!r}")


@attrs.frozen
class BucketingOptions:
    """The ``[aggregator]`` keys ``bucketing`` accepts."""

    #: Contributions averaged per bucket (the paper's s; 2 is its usual choice).
    bucket_size: int = attrs.field(default=2, validator=_bucket_size)
    #: The aggregator that combines the bucket means (any registered name).
    inner: str = attrs.field(default="median", validator=_inner)
    #: Seed of the shuffle (with the round's contributions: the same round, the same buckets).
    seed: int = 0


def _bucketing(options: BucketingOptions) -> Any:
    from meshkit_robust.bucketing import Bucketing

    return Bucketing(bucket_size=options.bucket_size,
                     inner=meshkit.plugins.create("aggregator", options.inner),
                     seed=options.seed)


@meshkit.hookimpl
def meshkit_aggregators() -> Iterable[meshkit.Component]:
    return [
        meshkit.Component("bucketing", _bucketing, BucketingOptions,
                          summary="averages shuffled buckets of bucket_size contributions, "
                                  "then an inner aggregator (default median) combines them"),
    ]
