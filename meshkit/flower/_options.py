"""The ``[task]`` keys of a Flower client run as a meshkit task."""

from __future__ import annotations

from typing import Any

import attrs

from meshkit.options import default_from

__all__ = ["FlowerOptions", "AppOptions"]


def _partitions(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be at least 1 (the number of Flower "
                         f"partitions, one per meshkit client), got {value}")


@attrs.frozen(kw_only=True)
class FlowerOptions:
    """``[task]`` of a task built with :func:`meshkit.flower.task`."""

    #: ``context.node_config["num-partitions"]``: how many partitions the
    #: client's data loader cuts; meshkit client ``c`` is ``partition-id`` c.
    #: Left out, it is ``[strategy] clients`` (0 here means "not given").
    num_partitions: int = attrs.field(default=0, validator=_partitions,
                                      metadata=default_from("strategy", "clients"))
    #: ``"module:attribute"`` of the initial model, as a ``ServerApp`` builds it:
    #: a callable (or class) returning a torch ``nn.Module``, a ``state_dict``, a
    #: Flower ``ArrayRecord`` or a list of arrays. Needed by a Message-API
    #: ``ClientApp``; a ``client_fn``'s client is asked (``get_parameters``) without it.
    initial: str = ""
    #: ``context.run_config``: what ``[tool.flwr.app.config]`` holds in a Flower app.
    run_config: dict[str, Any] = attrs.field(factory=dict)
    #: The ``config`` every ``fit`` receives (Flower: the strategy's
    #: ``on_fit_config_fn``, here fixed for the run).
    fit_config: dict[str, Any] = attrs.field(factory=dict)
    #: A Message-API app's ``msg.content["config"]`` in a train message (the
    #: ``train_config`` a ``ServerApp`` passes to ``strategy.start``); the same
    #: thing as ``fit_config``, under the Message API's name: give one of them.
    train_config: dict[str, Any] = attrs.field(factory=dict)
    #: The ``config`` every ``evaluate`` receives (``on_evaluate_config_fn``;
    #: a Message-API app's ``evaluate_config``).
    evaluate_config: dict[str, Any] = attrs.field(factory=dict)
    #: A Message-API reply's ``MetricRecord`` key weighting its arrays and
    #: metrics (Flower's ``FedAvg(weighted_by_key=...)``).
    weighted_by_key: str = "num-examples"

    def __attrs_post_init__(self) -> None:
        if self.fit_config and self.train_config:
            raise ValueError("fit_config and train_config are the same config (Flower's "
                             "legacy and Message-API names for it); give one of them")


@attrs.frozen(kw_only=True)
class AppOptions(FlowerOptions):
    """``[task]`` of the registered task ``flower``: the client factory is named here."""

    #: ``"module:attribute"`` of a Flower ``ClientApp`` (Message API or built
    #: from a ``client_fn``) or of a ``client_fn`` (importable from the current
    #: directory, as ``[run] task`` references are).
    app: str
