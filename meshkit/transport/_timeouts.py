"""Every blocking call's timeout becomes a monotonic deadline here.

``timeout=None`` means the group's default (``NodeConfig.timeout``);
``math.inf`` waits for ever (a lost peer still ends the wait); a negative
or NaN timeout is refused. Deadlines are ``time.monotonic()`` values, so a
wall-clock change never shortens or stretches a wait.
"""

from __future__ import annotations

import math
import time

__all__ = ["deadline_after", "remaining", "shown"]


def deadline_after(timeout: float | None, default: float) -> float:
    """Monotonic deadline for ``timeout`` seconds (``None``: ``default``; inf allowed)."""
    if timeout is None:
        timeout = default
    if timeout < 0 or math.isnan(timeout):
        raise ValueError(f"timeout must be >= 0 seconds (or math.inf), got {timeout!r}")
    return time.monotonic() + timeout


def remaining(deadline: float) -> float:
    """Seconds left until ``deadline`` (negative once it passed)."""
    return deadline - time.monotonic()


def shown(timeout: float | None, default: float) -> str:
    """A timeout as an error message quotes it ("5 s"; ``None``: the default)."""
    return f"{default if timeout is None else timeout:g} s"
