"""The ``[task]`` keys every torch task accepts (attrs only: cheap to import).

A task with keys of its own subclasses :class:`TorchOptions` and passes the
subclass to :func:`meshkit.torch.task`; its factories receive the instance.
"""

from __future__ import annotations

from typing import Any

import attrs

from meshkit.options import non_negative, positive

__all__ = ["TorchOptions"]


def _device(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    if value != "auto" and value.split(":")[0] not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps', "
                         f"got {value!r}")


@attrs.frozen
class TorchOptions:
    """``[task]`` keys of a :func:`meshkit.torch.task`."""

    #: Learning rate, handed to the optimizer factory (``options.lr``).
    lr: float = attrs.field(default=0.01, validator=positive)
    #: Passes over the client's rows per federated fit.
    epochs: int = attrs.field(default=1, validator=positive)
    #: Minibatch size of a federated fit's DataLoader.
    batch_size: int = attrs.field(default=32, validator=positive)
    #: Batch size of evaluation (no gradients: larger is fine).
    eval_batch_size: int = attrs.field(default=256, validator=positive)
    #: ``auto`` picks cuda, then mps, then cpu; or name one.
    device: str = attrs.field(default="auto", validator=_device)
    #: DataLoader worker processes (0: load in the training process).
    loader_workers: int = attrs.field(default=0, validator=non_negative)
    #: torch intra-op threads in this process (0: leave torch's default). Set
    #: it to 1 when several workers share a few cores.
    threads: int = attrs.field(default=0, validator=non_negative)
    #: Where this node's own data is (a file or directory, read by the data
    #: factory as ``options.data``); set per node with ``meshkit node
    #: --task-option data=PATH``. Empty: the factory's default data.
    data: str = ""
