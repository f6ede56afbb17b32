"""Built-in transports: ``tcp`` (star and full mesh over TCP) and ``inproc`` (threads).

Only records and options classes live here, so listing plugins stays cheap:
the socket and numpy code loads when a factory runs.
"""

from __future__ import annotations

from typing import Any, ClassVar, Iterable, Mapping

import attrs

import meshkit

#: Why ``bf16_wire`` is refused (every built-in transport names it so).
BF16_WIRE_RETIRED = (
    "removed (issue 21): it narrowed only the model frames of the star reduce service "
    "(Group.all_reduce / reduce_round), which is gone; every round runs on the round "
    "engine, whose frames travel exactly. Remove the key")


@attrs.frozen
class TcpOptions:
    """Options of the ``tcp`` transport (the ``[transport]`` config table)."""

    #: Keys this transport no longer takes, and why (meshkit.options names them).
    retired_keys: ClassVar[Mapping[str, str]] = {"bf16_wire": BF16_WIRE_RETIRED}
    #: Largest frame body accepted, checked before anything is allocated.
    max_frame_bytes: int = 1 << 30
    #: Largest message accepted: one bigger than a segment (``[mesh] segment_bytes``)
    #: travels as a lead frame and segments; the lead's claim is checked against
    #: this before anything is allocated.
    max_message_bytes: int = 1 << 40
    #: Bytes a sender's unread messages on one tag may hold behind the oldest
    #: one (which may be any frame size); past it the sender is dropped.
    max_unread_bytes: int = 64 << 20


@attrs.frozen
class InprocOptions:
    """Options of the ``inproc`` transport (none left; kept so a retired key is named)."""

    #: Keys this transport no longer takes, and why (meshkit.options names them).
    retired_keys: ClassVar[Mapping[str, str]] = {"bf16_wire": BF16_WIRE_RETIRED}


def _start_relay(options: TcpOptions, **settings: Any) -> Any:
    # Imported only when a host relay starts (``meshkit relay``): the relay plays
    # the round engine's side (meshkit.train), which every node connecting over
    # tcp would otherwise import for nothing (docs/benchmarks.md, "ci2").
    from meshkit_tcp.relay import start_relay

    return start_relay(options, **settings)


def _tcp(options: TcpOptions) -> Any:
    from meshkit_tcp.tcp import TcpTransport

    return TcpTransport(options, relay_factory=_start_relay)


def _inproc(options: InprocOptions) -> Any:
    from meshkit_tcp.inproc import InprocTransport

    return InprocTransport(options)


@meshkit.hookimpl
def meshkit_transports() -> Iterable[meshkit.Component]:
    return [
        meshkit.Component(
            "tcp", _tcp, TcpOptions,
            summary="TCP star or full mesh, authenticated frames, optional UDP discovery, host relays"),
        meshkit.Component(
            "inproc", _inproc, InprocOptions,
            summary="ranks as threads of one process (fast tests of everything above the wire)"),
    ]
