"""The ``torchdist`` transport: the Group API on torch.distributed process groups.

Needs the ``torch`` extra (``pip install 'meshkit[torch]'``, or your own torch
build). Only the record and the options class live here, so ``meshkit
plugins`` lists ``torchdist`` (and ``import meshkit`` stays torch-free) on a
machine without torch; selecting it there is a :class:`meshkit.PluginError`
saying what to install.

torch.distributed authenticates nothing: ``torchdist`` refuses a
non-loopback rendezvous address unless ``[mesh] trust_network = true``
(``meshkit_torchdist.group`` says why; docs/security.md what it leaves
open). Launch with torchrun: ``torchrun --standalone --nproc-per-node 3 -m
meshkit_torchdist CONFIG`` (:mod:`meshkit_torchdist.launch`); with ``[transport]
mode = "spmd"`` every rank runs the same program (:mod:`meshkit_torchdist.spmd`).
"""

from __future__ import annotations

import os
from typing import Any, ClassVar, Iterable, Mapping, Sequence
from urllib.parse import urlparse

import attrs

import meshkit
from meshkit.transport_traits import TransportTraits

__all__ = ["TorchdistOptions", "init_method", "rendezvous"]


def init_method(options: Any, rank: int, bind: str, peers: Sequence[str]) -> str:
    """Where a rank meets the others: ``[transport] init_method``, else ``tcp://`` at its bind
    address (rank 0) or the first peer's, else ``env://`` (torchrun's environment)."""
    if options.init_method:
        return str(options.init_method)
    address = bind if rank == 0 and bind else (peers[0] if peers else "")
    return f"tcp://{address}" if address else "env://"


def rendezvous(options: Any, rank: int, bind: str, peers: Sequence[str]
               ) -> list[tuple[str, str]]:
    """The host a rank meets at, with the setting that chose it (:class:`TransportTraits`)."""
    method = init_method(options, rank, bind, peers)
    if method.startswith("env://"):
        host = os.environ.get("MASTER_ADDR", "")
        return [("MASTER_ADDR (the environment torchrun sets)", host)] if host else []
    if not method.startswith("tcp://"):
        return []  # refused as a ConfigError when the rank connects
    try:
        host = urlparse(method).hostname or ""
    except ValueError:
        return []
    setting = (f"[transport] init_method = {options.init_method!r}" if options.init_method
               else f"[mesh] bind = {bind!r}" if rank == 0 and bind
               else f"[mesh] peers ({peers[0]!r}; meshkit node --peers)")
    return [(setting, host)] if host else []

BACKENDS = ("auto", "gloo", "nccl")
#: ``[transport] mode`` values (:class:`TorchdistOptions`).
MODES = ("coordinator", "spmd")


@attrs.frozen
class TorchdistOptions:
    """Options of the ``torchdist`` transport (the ``[transport]`` config table)."""

    #: Where the ranks meet: ``"env://"`` (MASTER_ADDR, MASTER_PORT, RANK and
    #: WORLD_SIZE, as torchrun sets them) or ``"tcp://host:port"`` (rank 0
    #: hosts the store there). Empty: ``tcp://`` at the node's bind or peer
    #: address when it has one, else ``env://``.
    init_method: str = ""
    #: The all-reduce's backend: ``"gloo"`` (CPU), ``"nccl"`` (CUDA), or
    #: ``"auto"`` (nccl when torch sees a CUDA device, else gloo). Control
    #: messages always travel over gloo.
    backend: str = attrs.field(default="auto", validator=attrs.validators.in_(BACKENDS))
    #: Largest control frame body accepted, checked before anything is allocated.
    max_frame_bytes: int = attrs.field(default=1 << 30, validator=attrs.validators.gt(0))
    #: torch.distributed authenticates nothing: the kernel refuses a rendezvous that is
    #: not on loopback unless [mesh] trust_network (meshkit.transport.trust_refusal),
    #: in meshkit check and run before anything starts, and here at connect.
    traits: ClassVar[TransportTraits] = TransportTraits(authenticates=False,
                                                        rendezvous=rendezvous)
    #: Keys this transport no longer takes, and why (meshkit.options names them).
    retired_keys: ClassVar[Mapping[str, str]] = {"bf16_wire": (
        "removed (issue 21): it narrowed only the model frames of the star reduce service, "
        "which is gone; every frame travels exactly. Remove the key")}
    #: Seconds rank 0 waits for a rank to rendezvous (the process group forms
    #: only once every rank has started); at least ``[mesh] timeout``.
    join_timeout: float = attrs.field(default=300.0, validator=attrs.validators.gt(0))
    #: How ``torchrun ... -m meshkit_torchdist CONFIG`` organises its processes:
    #: ``"coordinator"`` (rank 0 coordinates, every other rank is a node) or
    #: ``"spmd"`` (every rank runs the same program: it plays its slice of each
    #: federated round and one all-reduce per round combines them;
    #: :mod:`meshkit_torchdist.spmd`). ``meshkit run`` refuses ``"spmd"``.
    mode: str = attrs.field(default="coordinator", validator=attrs.validators.in_(MODES))


def _torchdist(options: TorchdistOptions) -> Any:
    if options.mode == "spmd":
        raise meshkit.RefusedError(
            "[transport] mode = \"spmd\" is how torchrun runs this config: every process "
            "plays its slice of each round (torchrun --nproc-per-node N -m meshkit_torchdist "
            "CONFIG); meshkit run and meshkit node start a coordinator and workers instead. "
            "Run it under torchrun, or drop mode (or set transport = \"tcp\") to run it "
            "here")
    try:
        import torch.distributed as dist
    except ImportError as exc:
        raise meshkit.PluginError(
            f"the torchdist transport runs on torch.distributed, and torch is not importable "
            f"here ({exc}); install it (pip install 'meshkit[torch]', or your platform's "
            f"torch build), or select transport \"tcp\"") from None
    if not dist.is_available():
        raise meshkit.PluginError(
            "the torchdist transport needs torch.distributed, which this torch build lacks "
            "(torch.distributed.is_available() is False); select transport \"tcp\"")
    from meshkit_torchdist.group import TorchdistTransport

    return TorchdistTransport(options)


@meshkit.hookimpl
def meshkit_transports() -> Iterable[meshkit.Component]:
    return [meshkit.Component(
        "torchdist", _torchdist, TorchdistOptions,
        summary="torch.distributed process groups (gloo, nccl); torchrun env:// rendezvous; "
                "authenticates nothing")]
