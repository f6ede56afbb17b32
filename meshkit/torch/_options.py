"""The ``[task]`` keys every torch task accepts (attrs only: cheap to import).

A task with keys of its own subclasses :class:`TorchOptions` and passes the
subclass to :func:`meshkit.torch.task`; its factories receive the instance.
"""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["TorchOptions"]


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be positive, got {value}")


def _non_negative(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be zero or more, got {value}")


def _device(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    if value != "auto" and value.split(":")[0] not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps', "
                         f"got {value!r}")


@attrs.frozen
class TorchOptions:
    """``[task]`` keys of a :func:`meshkit.torch.task`."""

    #: Learning rate, handed to the optimizer factory (``options.lr``).
    lr: float = attrs.field(default=0.01, validator=_positive)
    #: Passes over the client's rows per federated fit.
    epochs: int = attrs.field(default=1, validator=_positive)
    #: Minibatch size of a federated fit's DataLoader.
    batch_size: int = attrs.field(default=32, validator=_positive)
    #: Batch size of evaluation (no gradients: larger is fine).
    eval_batch_size: int = attrs.field(default=256, validator=_positive)
    #: ``auto`` picks cuda, then mps, then cpu; or name one.
    device: str = attrs.field(default="auto", validator=_device)
    #: DataLoader worker processes (0: load in the training process).
    loader_workers: int = attrs.field(default=0, validator=_non_negative)
    #: torch intra-op threads in this process (0: leave torch's default). Set
    #: it to 1 when several workers share a few cores.
    threads: int = attrs.field(default=0, validator=_non_negative)
