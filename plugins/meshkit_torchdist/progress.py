"""How a torchrun-started run prints its progress: the lines of ``meshkit run``.

Both launch modes print through it -- the coordinator mode
(:mod:`meshkit_torchdist.launch`) and spmd's rank 0
(:mod:`meshkit_torchdist.spmd`) -- so neither imports the other for it.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["print_progress"]


def print_progress(event: Any) -> None:
    """The same progress lines as `meshkit run` (str(RunEvent)): rounds on stdout, the
    rest on stderr."""
    print(event, file=sys.stdout if event.kind == "round" else sys.stderr, flush=True)
