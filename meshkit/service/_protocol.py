"""What a node and the service say to each other, over one authenticated, encrypted channel.

The channel is :func:`meshkit.wire.handshake`'s (the same shared secret and
node-key proof as a run's mesh; session ``meshkit-serve``, the service as
rank 0 of a world of 2, the node as rank 1). Every message is one frame of
kind :data:`KIND` whose tag says which message it is and whose body is a
JSON table with one declared schema (the attrs classes below, structured
strictly: a missing field, an extra one or a wrong type is a
:class:`~meshkit.errors.ProtocolError` for its sender).

=========  ============  ======================================================
tag        from          body
=========  ============  ======================================================
HELLO      node          ``caps`` (the node's NodeCaps as JSON), ``version``
ASSIGN     service       ``run``, ``address`` (the run's coordinator),
                         ``rank``, ``world``, ``secret`` (the run's own),
                         ``encrypt``, ``timeout``
DONE       node          ``run``, ``ok``, ``detail`` (how its part ended)
REFUSED    service       ``detail``: why this node may not join; it exits 2
=========  ============  ======================================================

A node serves one ASSIGN at a time and answers it with DONE; it is sent
nothing else in between. A run's secret travels only in an ASSIGN, so only
the nodes the service chose for that run (those its ``authorized_nodes``
admits) can ever join its mesh.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from meshkit import wire
from meshkit.errors import ConfigError, ProtocolError
from meshkit.options import structure_strict

__all__ = ["KIND", "HELLO", "ASSIGN", "DONE", "REFUSED", "SESSION", "Hello", "Assign", "Done",
           "Refused", "send", "parse", "MAX_TEXT"]

KIND = 0x53  # "S": a service frame (the channel carries nothing else)
HELLO, ASSIGN, DONE, REFUSED = 1, 2, 3, 4
SESSION = b"meshkit-serve"
#: The longest string a message may carry (a detail, an address, a run id).
MAX_TEXT = 4096


def _text(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    if len(value) > MAX_TEXT:
        raise ValueError(f"{attribute.name}: at most {MAX_TEXT} characters, got {len(value)}")


@attrs.frozen
class Hello:
    caps: dict[str, Any]
    version: str = attrs.field(validator=_text)


@attrs.frozen
class Assign:
    run: str = attrs.field(validator=_text)
    address: str = attrs.field(validator=_text)
    rank: int = attrs.field(validator=attrs.validators.ge(1))
    world: int = attrs.field(validator=attrs.validators.ge(2))
    secret: str = attrs.field(validator=_text, repr=False)
    encrypt: bool = True
    timeout: float = attrs.field(default=30.0, validator=attrs.validators.gt(0))


@attrs.frozen
class Done:
    run: str = attrs.field(validator=_text)
    ok: bool
    detail: str = attrs.field(default="", validator=_text)


@attrs.frozen
class Refused:
    detail: str = attrs.field(validator=_text)


_SCHEMA: Mapping[int, type] = {HELLO: Hello, ASSIGN: Assign, DONE: Done, REFUSED: Refused}
_TAGS = {cls: tag for tag, cls in _SCHEMA.items()}


def send(channel: wire.Channel, message: Any) -> None:
    """Send one message (its tag from its class)."""
    channel.send(KIND, _TAGS[type(message)], attrs.asdict(message))


def parse(frame: wire.Frame, sender: str) -> Any:
    """The message a frame carries; a ProtocolError naming ``sender`` if it fits no schema."""
    cls = _SCHEMA.get(frame.tag) if frame.kind == KIND else None
    if cls is None:
        raise ProtocolError(f"{sender} sent frame kind {frame.kind} tag {frame.tag}, which is "
                            f"no service message")
    try:
        return structure_strict(frame.state, cls, where=f"{sender}: {cls.__name__}")
    except ConfigError as exc:
        raise ProtocolError(str(exc)) from None
