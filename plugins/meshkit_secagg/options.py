"""``[secure_aggregation]`` options of ``secagg+`` (docs/secure-aggregation.md, "Configuration")."""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["SecAggPlusOptions"]


def _auto_or(check: Any) -> Any:
    """A key that is ``"auto"`` or a number ``check`` accepts (bool is never a number)."""
    def validate(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value == "auto":
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{attribute.name} must be \"auto\" or a number, got {value!r}")
        check(attribute.name, value)
    return validate


def _degree(name: str, value: Any) -> None:
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0 (0: the complete graph) or "
                         f"\"auto\", got {value!r}")


def _threshold(name: str, value: Any) -> None:
    if isinstance(value, int) and value < 2 or isinstance(value, float) and not 0 < value < 1:
        raise ValueError(f"{name} must be a number of shares >= 2, a fraction in (0, 1) of "
                         f"each client's shares, or \"auto\", got {value!r}")


@attrs.frozen
class SecAggPlusOptions:
    """SecAgg+'s keys; the cohort-dependent checks are made when a round is planned."""

    #: Neighbours each client masks with (SecAgg+'s k-regular graph); 0: every
    #: other client (SecAgg's complete graph); "auto": from the cohort size.
    degree: Any = attrs.field(default="auto", validator=_auto_or(_degree))
    #: Shares needed to reconstruct a client's secrets: an integer, a fraction of
    #: the shares each client hands out, or "auto".
    threshold: Any = attrs.field(default="auto", validator=_auto_or(_threshold))
    #: Each coordinate of a client's update is clipped to [-clip_range, clip_range]
    #: before it is quantised.
    clip_range: float = attrs.field(default=8.0, validator=[attrs.validators.gt(0),
                                                            attrs.validators.le(1e12)])
    #: Masked vectors are integers mod 2**modulus_bits.
    modulus_bits: int = attrs.field(default=32, validator=[attrs.validators.ge(1),
                                                           attrs.validators.le(64)])
    #: Place each round's cohort on the workers along the graph's ring (the trait
    #: ``interleave``): a client's neighbours then fall on the workers evenly and
    #: ``degree = "auto"`` needs far fewer of them (8 at 100 clients over 4 workers,
    #: against 50). false: round-robin in client order, each rank's clients fixed
    #: by their ids (what a test that names them needs).
    interleave: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
