"""What a transport moves: one routed :class:`Message`, and the rules every payload obeys.

A payload is a *state*: a mapping of str keys to numpy arrays or JSON
values. The key :data:`META_KEY` is the transport's own (routing, round
numbers), so a user state may not use it. A message's ``kind`` is the frame
kind a transport labels it with; the kernel sends every message as
``"control"``, exactly (bfloat16 on the wire went with the star reduce
service, issue 21; ``meshkit.wire`` still offers it to direct channel users).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from meshkit.errors import WireError

__all__ = ["META_KEY", "KINDS", "Message", "check_state", "check_kind"]

#: Reserved payload key carrying transport metadata (routing, round numbers);
#: a user state may not use it.
META_KEY = "__meshkit__"

#: Frame kinds a transport labels a message with (the kernel sends "control").
KINDS = ("model", "control")


@attrs.frozen
class Message:
    """One routed message inside a group (what a transport moves).

    ``meta`` is small JSON the transport itself uses (round numbers,
    weights, relay source); ``payload`` is the user's state. ``kind``: the
    frame kind (one of :data:`KINDS`; the kernel sends ``"control"``).
    """

    src: int
    dst: int
    tag: int
    payload: Mapping[str, Any]
    meta: Mapping[str, Any] = attrs.Factory(dict)
    kind: str = "control"
    #: The transport's received frame, so a relay can forward it unchanged.
    raw: Any = attrs.field(default=None, eq=False, repr=False)
    #: ``time.monotonic()`` by which the whole write must be done, or None.
    #: A transport that can bound a write (see ``Links.send_deadlines``)
    #: drops the link when it passes; others may ignore it.
    deadline: float | None = attrs.field(default=None, eq=False, repr=False)


def check_state(payload: Any, what: str = "payload") -> Mapping[str, Any]:
    """A state must be a mapping with str keys; the reserved key is refused."""
    # collections.abc.Mapping, not typing.Mapping: the typing alias's
    # isinstance is three Python calls, on every message sent.
    if type(payload) is not dict and not isinstance(payload, Mapping):
        raise WireError(
            f"{what} must be a mapping of name -> numpy array or JSON value, "
            f"got {type(payload).__name__}")
    # Every message sent comes through here: the keys' types are gathered in C (a key
    # at a time was two lines of Python an entry, issue 36), and a key that is not a
    # plain str is looked at one by one.
    if not _PLAIN_KEYS.issuperset(map(type, payload)):
        for key in payload:
            if not isinstance(key, str):
                raise WireError(f"{what}: every key must be a str, got {key!r}")
    if META_KEY in payload:
        raise WireError(f"{what}: key {META_KEY!r} is reserved for the transport; rename it")
    return payload


_PLAIN_KEYS = frozenset({str})


def check_kind(kind: str) -> str:
    """``kind`` if it is one of :data:`KINDS`, else ``ValueError``."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return kind
