"""meshkit's exception hierarchy.

Every error a user can act on is a :class:`MeshError`; the CLI turns one into
a one-paragraph message and exit status 2. Anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations

__all__ = [
    "MeshError",
    "ConfigError",
    "PluginError",
    "UnknownComponentError",
    "RefusedError",
    "AggregationError",
    "PlacementError",
    "WireError",
    "AuthenticationError",
    "PeerLostError",
    "WorkerError",
    "StateError",
    "BoardError",
    "BoardTimeoutError",
    "ProtocolError",
    "DigestMismatchError",
]


class MeshError(Exception):
    """Base of every error meshkit raises on purpose."""


class ConfigError(MeshError):
    """A configuration file, table or value is wrong (names file, table, key)."""


class PluginError(MeshError):
    """A plugin failed to load, broke a hook contract, or clashed with another."""


class UnknownComponentError(PluginError, LookupError):
    """A config or API call selected a component name no loaded plugin offers."""


class RefusedError(MeshError):
    """A component declines a job it cannot do honestly.

    The message says what it would need and what works instead; a refusal
    never computes a plausible-looking number.
    """


class AggregationError(MeshError, ValueError):
    """Contributions cannot be combined (missing key, shape, dtype, weight...)."""


class PlacementError(MeshError):
    """Work was placed on a node that cannot run it."""


class WireError(MeshError):
    """A frame or datagram is malformed, oversized, or the peer broke protocol."""


class AuthenticationError(WireError):
    """A frame failed authentication: wrong secret, forged, replayed or reordered."""


class DigestMismatchError(WireError):
    """A resumed transfer's whole body does not match the digest its first lead announced.

    Every segment was authenticated, so the sender's body changed between the
    attempts (or it offered another message under the transfer's id); the
    partial is discarded and the message must be sent again from the start.
    """


class PeerLostError(MeshError):
    """A peer disconnected, stalled past its timeout, or was declared dead."""


class WorkerError(MeshError):
    """A worker answered a request with an error: its task raised, or cannot be built.

    Not a lost peer (the worker is alive and said why); ``rank`` is the
    worker, ``detail`` its message, so the runner can say where the worker's
    traceback is.
    """

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(f"rank {rank}: {detail}")
        self.rank = rank
        self.detail = detail


class StateError(MeshError, ValueError):
    """A state breaks the state model (bad key, unsupported dtype, NaN, ...)."""


class BoardError(MeshError):
    """A board failed to run an activation (raised, crashed or is wedged)."""


class BoardTimeoutError(BoardError, TimeoutError):
    """A board did not answer within its deadline."""


class ProtocolError(WireError):
    """A peer sent a message that does not fit its declared schema.

    Raised at the boundary where a message enters (``meshkit/train/_messages.py``):
    a missing or unknown field, a wrong type, a value out of range, a state
    that does not match the round's model. It costs its sender its rank -- the
    coordinator declares that rank dead with this message as the reason --
    never the run. ``rank`` is the sender when known (None otherwise).
    """

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
