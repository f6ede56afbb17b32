"""The ``[task]`` keys of a Flower client run as a meshkit task."""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["FlowerOptions", "AppOptions"]


def _at_least_one(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be at least 1 (the number of Flower "
                         f"partitions, one per meshkit client), got {value}")


@attrs.frozen(kw_only=True)
class FlowerOptions:
    """``[task]`` of a task built with :func:`meshkit.flower.task`."""

    #: ``context.node_config["num-partitions"]``: how many partitions the
    #: client's data loader cuts; meshkit client ``c`` is ``partition-id`` c,
    #: so set ``[strategy] clients`` to the same number.
    num_partitions: int = attrs.field(validator=_at_least_one)
    #: ``context.run_config``: what ``[tool.flwr.app.config]`` holds in a Flower app.
    run_config: dict[str, Any] = attrs.field(factory=dict)
    #: The ``config`` every ``fit`` receives (Flower: the strategy's
    #: ``on_fit_config_fn``, here fixed for the run).
    fit_config: dict[str, Any] = attrs.field(factory=dict)
    #: The ``config`` every ``evaluate`` receives (``on_evaluate_config_fn``).
    evaluate_config: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class AppOptions(FlowerOptions):
    """``[task]`` of the registered task ``flower``: the client factory is named here."""

    #: ``"module:attribute"`` of the Flower ``client_fn``, or of a ``ClientApp``
    #: built from one (importable from the current directory, as ``[run] task``
    #: references are).
    app: str
