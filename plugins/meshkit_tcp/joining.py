"""The words of joining a tcp mesh: frame kinds, handshake roles, the welcome and the refusal.

Rule: what a dialer and the accepting side say to each other right after
the wire handshake (docs/protocol.md section 2) is decided here: the
handshake ``role`` byte each topology sends, the welcome frame, the
refusal, and how a dialer reads the answer.
"""

from __future__ import annotations

import time

from meshkit import wire
from meshkit.errors import MeshError, PeerLostError, WireError
from meshkit.transport import TAG_WELCOME

__all__ = [
    "KIND_CONTROL",
    "KIND_MODEL",
    "KIND_NAMES",
    "MAX_REFUSED",
    "ROLE_MESH",
    "ROLE_NAMES",
    "ROLE_REDIAL",
    "ROLE_RELAY",
    "ROLE_STAR",
    "STALE_LINK_WAIT",
    "read_welcome",
    "send_refusal",
]

#: Frame kind bytes (informative: the tag routes, the kind says how it travelled).
KIND_CONTROL = 1
KIND_MODEL = 2
KIND_NAMES = {KIND_CONTROL: "control", KIND_MODEL: "model"}
#: How long a restarted rank's admission waits for its dead predecessor's
#: link to be dropped (seconds).
STALE_LINK_WAIT = 10.0

#: The handshake's ``role`` field carries the dialer's topology, so the
#: accepting side can refuse a mismatch before anything else happens.
ROLE_STAR = 1
ROLE_MESH = 2
#: A host relay dialing a star's coordinator for the ranks it carries.
ROLE_RELAY = 3
#: A star worker dialing its coordinator again after its link was cut, in the
#: same process (``[mesh] resume_seconds``): it asks for its held link back.
ROLE_REDIAL = 4
ROLE_NAMES = {ROLE_STAR: "star", ROLE_MESH: "mesh", ROLE_RELAY: "relay", ROLE_REDIAL: "star"}
#: How many refusals ``group.refused`` keeps (the newest).
MAX_REFUSED = 256


def send_refusal(channel: wire.Channel, problem: str) -> None:
    """Tell a peer just handshaken why it is not admitted (best effort), then close its link."""
    try:
        channel.send(KIND_CONTROL, TAG_WELCOME, {"ok": False, "error": problem})
    except (MeshError, OSError):
        pass
    channel.close()


def read_welcome(channel: wire.Channel, rank: int, address: str, deadline: float, *,
                 me: int, topology: str) -> None:
    """Read the accepting side's answer to the handshake: return if welcomed, else raise.

    A refusal is a :class:`WireError` quoting the peer's reason; no answer
    within ``deadline`` is a :class:`PeerLostError`; a welcome from a node of
    the other topology is a :class:`WireError` naming both. The channel is
    closed on any failure.
    """
    try:
        frame = channel.recv(timeout=max(0.001, deadline - time.monotonic()))
    except PeerLostError as exc:
        channel.close()
        raise PeerLostError(f"rank {rank} at {address} accepted the handshake but sent no "
                            f"welcome: {exc}") from None
    if frame.tag != TAG_WELCOME or not isinstance(frame.state.get("ok"), bool):
        channel.close()
        raise WireError(f"rank {rank} at {address} answered the handshake with an "
                        f"unexpected frame (tag 0x{frame.tag:X}); is it a meshkit node of "
                        f"the same release?")
    if not frame.state["ok"]:
        channel.close()
        raise WireError(f"rank {rank} at {address} refused rank {me}: "
                        f"{frame.state.get('error')}")
    if frame.state.get("topology") != topology:
        channel.close()
        raise WireError(f"rank {rank} at {address} runs a {frame.state.get('topology')} "
                        f"topology, this node (rank {me}) a {topology}; give every node the "
                        f"same peers form")
