"""Built-in outer optimizers: how the global model steps from a round's consensus.

``average`` adopts the consensus; ``nesterov`` (DiLoCo), ``fedavgm``,
``fedadagrad``, ``fedadam`` and ``fedyogi`` (Reddi et al., *Adaptive
Federated Optimization*, 2020) descend on the pseudo-gradient
``g = global - consensus``. Rules and defaults: DESIGN section 4 and
docs/outer-optimizers.md.

This module only declares records and options classes; the numerics load
when a factory runs, so listing plugins stays fast.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import attrs

import meshkit


def _positive(instance: Any, attribute: Any, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name} must be a finite number > 0, got {value!r}")


def _unit(instance: Any, attribute: Any, value: float) -> None:
    if not (isinstance(value, (int, float)) and 0 <= value < 1):
        raise ValueError(f"{attribute.name} must be in [0, 1), got {value!r}")


@attrs.frozen
class NesterovOptions:
    """``[outer_optimizer] name = "nesterov"`` keys."""

    lr: float = attrs.field(default=0.7, validator=_positive)
    momentum: float = attrs.field(default=0.9, validator=_unit)


@attrs.frozen
class FedAvgMOptions:
    """``[outer_optimizer] name = "fedavgm"`` keys."""

    lr: float = attrs.field(default=1.0, validator=_positive)
    momentum: float = attrs.field(default=0.9, validator=_unit)


@attrs.frozen
class FedAdagradOptions:
    """``[outer_optimizer] name = "fedadagrad"`` keys."""

    lr: float = attrs.field(default=0.1, validator=_positive)
    beta1: float = attrs.field(default=0.9, validator=_unit)
    tau: float = attrs.field(default=1e-3, validator=_positive)


@attrs.frozen
class FedAdamOptions:
    """``[outer_optimizer] name = "fedadam"`` keys."""

    lr: float = attrs.field(default=0.1, validator=_positive)
    beta1: float = attrs.field(default=0.9, validator=_unit)
    beta2: float = attrs.field(default=0.99, validator=_unit)
    tau: float = attrs.field(default=1e-3, validator=_positive)
    #: Divide m by 1 - beta1^t and v by 1 - beta2^t (t = rounds from 1). With
    #: it fedadam is Adam: v starts at 0, not tau^2 (docs/outer-optimizers.md).
    bias_correction: bool = False


@attrs.frozen
class FedYogiOptions:
    """``[outer_optimizer] name = "fedyogi"`` keys."""

    lr: float = attrs.field(default=0.01, validator=_positive)
    beta1: float = attrs.field(default=0.9, validator=_unit)
    beta2: float = attrs.field(default=0.99, validator=_unit)
    tau: float = attrs.field(default=1e-3, validator=_positive)


def _factory(class_name: str) -> Any:
    def factory(options: Any = None) -> Any:
        from meshkit_outer import optimizers

        cls = getattr(optimizers, class_name)
        return cls() if options is None and class_name == "Average" else cls(options)

    factory.__name__ = f"build_{class_name.lower()}"
    return factory


@meshkit.hookimpl
def meshkit_outer_optimizers() -> Iterable[meshkit.Component]:
    return [
        meshkit.Component(
            "average", _factory("Average"), also_known_as=("FedAvg",),
            summary="adopt the consensus as the new global model (plain FedAvg)"),
        meshkit.Component(
            "nesterov", _factory("Nesterov"), NesterovOptions,
            summary="DiLoCo outer Nesterov momentum on g = global - consensus"),
        meshkit.Component(
            "fedavgm", _factory("FedAvgM"), FedAvgMOptions,
            summary="server momentum (FedAvgM) on g = global - consensus"),
        meshkit.Component(
            "fedadagrad", _factory("FedAdagrad"), FedAdagradOptions,
            summary="FedAdagrad (Reddi et al. 2020) on g = global - consensus"),
        meshkit.Component(
            "fedadam", _factory("FedAdam"), FedAdamOptions,
            summary="FedAdam (Reddi et al. 2020) on g = global - consensus"),
        meshkit.Component(
            "fedyogi", _factory("FedYogi"), FedYogiOptions,
            summary="FedYogi (Reddi et al. 2020) on g = global - consensus"),
    ]
