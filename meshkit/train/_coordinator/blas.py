"""The coordinator's BLAS pool when its workers share this machine: one thread.

Why. numpy's wheels ship OpenBLAS with a pool of one thread per core. A
matrix product above OpenBLAS's size threshold (the coordinator's
evaluation of the global model on its held-out split each round: digits'
359 x 64 by 64 x 32 is one) wakes the pool, and a woken pool thread
*spins* for about 0.1 s before it sleeps again (OpenBLAS's thread
timeout, 2^28 cycles). A round that comes back sooner (a flat 3-on-3
digits round takes ~10 ms) finds it still spinning, so the thread never
sleeps: it burns a whole core for the whole run, about 10 of a round's
25 ms of CPU on a 2-core machine (docs/benchmarks.md, "The flat round's
hand-offs"), on the cores the local workers train on. torchrun's rule
for the same problem is one thread per process when it starts several on
one machine; here the coordinator's pool is cut to one thread when it
spawns its local workers (:func:`share_cores`) and given back when they
are reaped (:func:`give_back`: a notebook that ran a job keeps its pool for
what it does next), unless the user chose a count (``OPENBLAS_NUM_THREADS``,
``GOTO_NUM_THREADS`` or ``OMP_NUM_THREADS``), which is then left alone.

OpenBLAS reads those variables only when it loads (with numpy, long before
a config is read), so the count is set at run time through OpenBLAS's own
``openblas_set_num_threads`` (under the symbol names numpy's wheels and
distributions export). A BLAS that is not OpenBLAS, or one not found, is
left as it is: :func:`share_cores` then returns ``None``. One thread
changes no result: OpenBLAS splits a product's output between its threads,
each element summed over the same blocks by the same kernel either way.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["share_cores", "give_back", "blas_threads", "USER_CHOICE"]

#: The variables with which a user chooses OpenBLAS's thread count (read by
#: OpenBLAS at load); any of them set means the user's count stands.
USER_CHOICE = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")

_SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
            "openblas_set_num_threads64_", "openblas_set_num_threads")
_GETTERS = ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads",
            "openblas_get_num_threads64_", "openblas_get_num_threads")


def _loaded_openblas() -> list[str]:
    """Paths of the OpenBLAS libraries this process has loaded (numpy's first)."""
    here = Path(np.__file__).resolve().parent
    found = [str(p) for where in (here.parent / "numpy.libs", here / ".dylibs")
             if where.is_dir() for p in sorted(where.iterdir()) if "openblas" in p.name]
    try:  # Linux: any other OpenBLAS numpy was linked against (a distribution's)
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                path = line.rstrip("\n").partition("/")[2]
                if path and "openblas" in path.rpartition("/")[2] and "/" + path not in found:
                    found.append("/" + path)
    except OSError:
        pass
    return found


@functools.cache
def _function(names: tuple[str, ...]) -> Any:
    """The first of ``names`` a loaded OpenBLAS exports, or ``None``: looked up once a
    process (numpy loads its BLAS at import, before any run asks), not by reading
    ``/proc/self/maps`` and opening the libraries again on every count asked or set."""
    for path in _loaded_openblas():
        try:
            library = ctypes.CDLL(path)  # already loaded: the same handle numpy uses
        except OSError:
            continue
        for name in names:
            function = getattr(library, name, None)
            if function is not None:
                return function
    return None


def blas_threads() -> int | None:
    """OpenBLAS's thread count in this process, or ``None`` when no OpenBLAS is found."""
    getter = _function(_GETTERS)
    if getter is None:
        return None
    getter.restype = ctypes.c_int
    return int(getter())


def _set_threads(count: int) -> bool:
    setter = _function(_SETTERS)
    if setter is None:
        return False
    setter.argtypes = [ctypes.c_int]
    setter.restype = None
    setter(count)
    return True


_lock = threading.Lock()
#: The runs sharing this machine's cores now (their process tables' ids), and
#: the pool's count before the first of them: the last one gives it back.
_sharing: set[int] = set()
_before: list[int] = []


def share_cores(owner: object) -> int | None:
    """Cut this process's OpenBLAS pool to one thread while ``owner``'s workers run.

    Nothing is changed when the user chose a count (:data:`USER_CHOICE`) or no
    OpenBLAS is found. Returns the count now in force (``None``: no OpenBLAS).
    """
    if any(os.environ.get(name) for name in USER_CHOICE):
        return blas_threads()
    with _lock:
        if not _sharing:
            before = blas_threads()
            if before is None or not _set_threads(1):
                return None
            _before[:] = [before]
        _sharing.add(id(owner))
    return blas_threads()


def give_back(owner: object) -> None:
    """``owner``'s workers are gone: the pool's count before the first run that shared, when it
    was the last one (a notebook's later products get their threads back)."""
    with _lock:
        if id(owner) not in _sharing:
            return
        _sharing.discard(id(owner))
        if not _sharing and _before:
            _set_threads(_before.pop())
