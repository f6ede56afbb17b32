"""Model-sized sum arenas kept for the next round's fold once nothing refers to them (issue 39).

A mean's accumulators are views into one arena per accumulation dtype
(:class:`meshkit.aggregation.MeanFold`), and in float32 its result *is* the
arena: the round's result, then the next global model. A fresh arena is a
fresh mapping that the kernel zeroes page by page as the first contribution
is folded into it, every round; on the benchmark host that zeroing cost more
than the fold's own arithmetic (docs/benchmarks.md, issue 39). So an arena of
at least :data:`ARENA_MIN` bytes is kept when it is made, and handed to a later
fold of the same size and dtype once nothing refers to it any more: the
round before last's model, dropped when the last round's result replaced it.

Nothing is ever overwritten while in use: a numpy view keeps its base
alive, so the arena's reference count says exactly whether a result, a
view of one or anything built on its memory (``torch.from_numpy``, a
memoryview) is still around; it is checked under a lock, and the taker
holds its reference from then on. At most :data:`KEEP` arenas are kept: the
model in use and the one before it, so the peak is the fold's as before
(the global model and the sum); what changes is that the idle one stays
resident between rounds instead of being unmapped and mapped again.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

__all__ = ["ARENA_MIN", "KEEP", "arena", "forget_arenas"]

#: Arenas below this many bytes are fresh each time: glibc's largest mmap threshold,
#: below which a freed block is reused from the heap already mapped; a larger one is
#: always a fresh mapping the kernel zeroes page by page (5 ms of a 25 ms fold of
#: 10 x 10M float32 here, issue 36; this was 64 MiB until then).
ARENA_MIN = 32 << 20
#: Arenas kept: the one the global model is, and the one the next fold takes.
KEEP = 2

_kept: list[np.ndarray] = []
_lock = threading.Lock()


def arena(dtype: np.dtype, size: int) -> np.ndarray:
    """An uninitialised 1-D array of ``size`` elements of ``dtype``: a kept one nothing
    refers to any more, or a new one (kept when it is model-sized, module docstring)."""
    if size * dtype.itemsize < ARENA_MIN:
        return np.empty(size, dtype=dtype)
    with _lock:
        # By index: no loop variable may hold a slot while its references are counted
        # (the list's and getrefcount's argument are an idle slot's only ones).
        for i in range(len(_kept)):
            if _kept[i].dtype == dtype and _kept[i].size == size \
                    and sys.getrefcount(_kept[i]) <= 2:
                return _kept[i]
        fresh = np.empty(size, dtype=dtype)
        for i in range(len(_kept)):
            if sys.getrefcount(_kept[i]) <= 2:  # idle, another model's: replaced
                _kept[i] = fresh
                return fresh
        if len(_kept) < KEEP:
            _kept.append(fresh)
        return fresh


def forget_arenas() -> None:
    """Drop every kept arena (those still in use live on with their users)."""
    with _lock:
        _kept.clear()
