"""Run control: what bounds a node, and the one wait through which it is observed.

:class:`NodeControl` carries a step budget and a stop handle another thread
(a signal handler, an app going to the background) can raise. A node parked
waiting for a message observes it through :func:`recv_polling`, which
re-checks the stop handle every :data:`POLL_INTERVAL` seconds; while serving,
the activation loop checks it between activations.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import attrs

from meshkit.errors import ConfigError, PeerLostError

__all__ = ["NodeControl", "POLL_INTERVAL", "recv_polling"]

#: How often a node parked waiting for work re-checks its stop handle (seconds).
POLL_INTERVAL = 0.2


@attrs.define
class NodeControl:
    """Bounds a node: a step budget, plus a stop handle another thread can raise.

    A node on a phone or a shared board gets backgrounded, throttled or
    unplugged, and must be able to leave without waiting for the job to end.
    Both are observed *between* activations: the one in progress always
    completes and is sent on. ``steps`` counts activations over the node's
    whole life (every job), so ``NodeControl(steps=3)`` serves exactly three
    and then leaves.
    """

    steps: int | None = attrs.field(default=None)
    _stop: threading.Event = attrs.field(factory=threading.Event, alias="stop_event")
    done: int = attrs.field(default=0, init=False)
    #: How :func:`~meshkit.node.serve_node` ended: ``"shutdown"`` (the
    #: coordinator ended the run), ``"coordinator lost"``, ``"refused"``,
    #: ``"stop"`` or ``"budget"``; None while it serves. ``meshkit node``
    #: exits 0 only for ``"shutdown"``.
    ended: str | None = attrs.field(default=None, init=False)
    #: The coordinator's reason when ``ended == "refused"``.
    refusal: str = attrs.field(default="", init=False)

    @steps.validator
    def _check_steps(self, attribute: Any, value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            raise ConfigError(f"NodeControl steps must be a non-negative integer, got {value!r}")

    def stop(self) -> None:
        """Ask the node to leave after its current activation (thread-safe)."""
        self._stop.set()

    @property
    def stop_handle(self) -> threading.Event:
        """The event to ``set()`` from another thread to stop the node."""
        return self._stop

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    @property
    def budget_spent(self) -> bool:
        return self.steps is not None and self.done >= self.steps

    def should_continue(self) -> bool:
        """Whether another activation may be served."""
        return not self.stopped and not self.budget_spent

    def reason(self) -> str | None:
        """Why serving must end (``"stop"``, ``"budget"``), or None."""
        # Asked before every activation: spelled out rather than through the
        # properties above (this is the serving path's per-frame check).
        if self._stop.is_set():
            return "stop"
        steps = self.steps
        if steps is not None and self.done >= steps:
            return "budget"
        return None

    def count(self, n: int = 1) -> None:
        # ``done`` has no validator: skip the class's validating __setattr__,
        # a Python call on every activation served.
        object.__setattr__(self, "done", self.done + n)


def recv_polling(group: Any, src: int, tag: int, control: NodeControl | None,
                 timeout: float, abort: Callable[[], bool] | None = None) -> Any:
    """``recv`` that re-checks ``control``'s stop handle every :data:`POLL_INTERVAL`.

    Returns None when the stop handle fired while waiting (or ``abort()``
    returned true). A peer that is lost still raises :class:`PeerLostError`
    at once; ``timeout`` bounds the wait.
    """
    deadline = time.monotonic() + timeout
    idle = False
    while True:
        if control is not None and control.stopped:
            return None
        # Only when nothing arrived for a whole poll: frames already queued
        # (activations sent before the abort) are still served in order.
        if idle and abort is not None and abort():
            return None
        idle = True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise PeerLostError(
                f"rank {group.rank}: nothing from rank {src} within {timeout:g} s")
        polling = control is not None or abort is not None
        wait = min(remaining, POLL_INTERVAL) if polling else remaining
        started = time.monotonic()
        try:
            return group.recv(src, tag, timeout=wait)
        except PeerLostError:
            dead = group.dead
            waited = time.monotonic() - started
            # The transport says "lost" both for a dead peer and for a quiet
            # one; only the quiet one is worth waiting for again.
            if src in dead or 0 in dead or waited < wait * 0.5:
                raise
