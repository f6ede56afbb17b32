"""Options (the ``[partitioner]`` keys) of the built-in partitioners: attrs only."""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["NoOptions", "DirichletOptions", "PathologicalOptions"]


#: The largest Dirichlet alpha: past it numpy's draw is no split (zeros or NaN shares).
MAX_ALPHA = 1e6


def _positive_alpha(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not value > 0:
        raise ValueError(
            f"alpha must be greater than 0 (small: each client holds few labels, e.g. 0.1; "
            f"large: close to iid, e.g. 100), got {value}")
    if not value <= MAX_ALPHA:
        # numpy's Dirichlet draw gives zeros (1e308) or NaN (inf) shares up there, and
        # far below it the split is already iid: a split of garbage must not pass check.
        raise ValueError(
            f"alpha must be at most {MAX_ALPHA:g} (the split is iid well before that; use "
            f"[partitioner] name = \"iid\"), got {value}")


def _at_least_one(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be at least 1, got {value}")


@attrs.frozen
class NoOptions:
    """``contiguous``, ``iid`` and ``local`` take no keys."""


@attrs.frozen
class DirichletOptions:
    """``[partitioner] name = "dirichlet"``."""

    #: Concentration of each label's Dirichlet over the clients: the smaller,
    #: the more each client's data is dominated by a few labels.
    alpha: float = attrs.field(default=0.5, validator=_positive_alpha)


@attrs.frozen
class PathologicalOptions:
    """``[partitioner] name = "pathological"`` (McMahan et al. 2017's shards)."""

    #: Distinct labels each client holds.
    classes_per_client: int = attrs.field(default=2, validator=_at_least_one)
