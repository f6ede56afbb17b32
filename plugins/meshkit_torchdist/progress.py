"""How a torchrun rank prints a run's progress: the very lines ``meshkit run`` prints.

Its own module so the coordinator mode (:mod:`meshkit_torchdist.launch`) and the spmd
mode (:mod:`meshkit_torchdist.spmd`) share it without importing each other.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["print_progress"]


def print_progress(event: Any) -> None:
    """The same progress lines as `meshkit run` (str(RunEvent)): rounds on stdout, the
    rest on stderr."""
    print(event, file=sys.stdout if event.kind == "round" else sys.stderr, flush=True)
