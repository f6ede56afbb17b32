"""The coordinator's BLAS pool when its workers share this machine: one thread.

Why. numpy's wheels ship OpenBLAS with a pool of one thread per core. A
matrix product above OpenBLAS's size threshold (the coordinator's
evaluation of the global model on its held-out split each round: digits'
360 x 64 by 64 x 32 is one) wakes the pool, and a woken pool thread
*spins* for about 0.1 s before it sleeps again (OpenBLAS's thread
timeout, 2^28 cycles). A round that comes back sooner (a flat 3-on-3
digits round takes ~10 ms) finds it still spinning, so the thread never
sleeps: it burns a whole core for the whole run, about 10 of a round's
25 ms of CPU on a 2-core machine (docs/benchmarks.md, "The flat round's
hand-offs"), on the cores the local workers train on. torchrun's rule
for the same problem is one thread per process when it starts several on
one machine; here the coordinator's pool is cut to one thread when it
spawns its local workers, unless the user chose a count
(``OPENBLAS_NUM_THREADS``, ``GOTO_NUM_THREADS`` or ``OMP_NUM_THREADS``),
which is then left alone.

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
import os
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["share_cores", "blas_threads", "USER_CHOICE"]

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


def _function(names: tuple[str, ...]) -> Any:
    """The first of ``names`` a loaded OpenBLAS exports, or ``None``."""
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


def share_cores() -> int | None:
    """Cut this process's OpenBLAS pool to one thread, unless the user chose a count.

    Returns the count now in force (``None``: no OpenBLAS found, nothing done).
    """
    if any(os.environ.get(name) for name in USER_CHOICE):
        return blas_threads()
    setter = _function(_SETTERS)
    if setter is None:
        return None
    setter.argtypes = [ctypes.c_int]
    setter.restype = None
    setter(1)
    return blas_threads()
