"""The strict mean's fold in one pass a chunk: a small C loop, compiled on this machine on first use.

Why. numpy has no fused operation for ``acc += f0*x0 + f1*x1``: the fold
makes five passes a chunk of a pair (two scaling multiplies streaming the
inputs from memory, an add in cache, the accumulator's round trip, the
finiteness check), and on two threads each of those short calls hands the
GIL back and forth. One C loop does the same arithmetic in one pass, and a
call folds a whole task (about a million elements) with the GIL released.
On the benchmark host it took the fold of 10 x 10M float32 from 0.45-0.50x
of ``np.sum``'s read bandwidth to the figures in docs/benchmarks.md.

The same bits. Every element goes through the very operations numpy's
passes apply, each rounded to float32 on its own: ``x * f`` (only where
numpy scales), ``+`` the second input's, ``+`` the accumulator's (or
nothing on the first fold), ``/ divisor`` on the last. The C is compiled
with ``-ffp-contract=off`` and without ``-ffast-math``, so no multiply-add is
fused (a fused one rounds once, and whether a CPU fuses would change the
bits host to host); :mod:`._mean` falls back to numpy's passes wherever the
kernel does not apply, and both give the result bit for bit
(tests/aggregation/test_fold_kernel.py). The per-chunk finiteness check
sums the chunk's squares in float32 like ``np.dot`` does, in 16 lanes: the
order differs, which can only move a borderline overflow, and any alarm is
decided element by element (``_alarm``) exactly as before.

Where it applies: float32 sums of float32 inputs, one or two at a time
(``retain`` 0 or 1), each C-contiguous and aligned, in a fold of a million
float elements or more. Anything else -- float64, bfloat16 or float16 inputs
(widened first), larger groups, small folds -- takes numpy's passes.

Building it. The first large fold in a process looks for the compiled
library in meshkit's cache (``$MESHKIT_CACHE``, else ``$XDG_CACHE_HOME/meshkit``,
else ``~/.cache/meshkit``; under ``kernels/``, named by a hash of the source,
flags and compiler) and, when it is missing, compiles it with the C compiler
(``$CC``, else ``cc``) into a temporary file renamed into place, so processes
that start at once do not see a half-written one. The directory is created
private (0700); a directory or library another user owns, or that others
may write, is not loaded (numpy's passes instead), as it could run any code
in this process. No compiler, a failed build, a platform without ``dlopen``
(Windows), or ``MESHKIT_FOLD_KERNEL=0``: numpy's passes, the same bits,
slower -- :func:`status` says which and why (and the reason is logged, at debug level).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

__all__ = ["SOURCE", "FLAGS", "MIN_ELEMENTS", "fold_kernel", "status", "cache_dir"]

log = logging.getLogger(__name__)

#: Folds of fewer float elements (over all arrays) keep numpy's passes: a ctypes call
#: costs about what a small chunk's passes do, and the first call builds the library.
MIN_ELEMENTS = 1 << 20

#: ``meshkit_fold_f32(acc, x0, f0, s0, x1, f1, s1, lo, hi, init, chunk, check, div, d)``:
#: ``acc[lo:hi]`` (+)= ``x0*f0 (+ x1*f1)``, chunk by chunk from ``lo``; the start of the
#: first chunk whose sum of squares (before dividing) is not finite, or -1.
SOURCE = r"""
#include <stdint.h>
#include <math.h>
#define LANES 16
static inline __attribute__((always_inline)) float pass(
        float *restrict acc, const float *restrict x0, float f0, int s0,
        const float *restrict x1, float f1, int s1, int init, int64_t lo, int64_t hi)
{
    float lane[LANES] = {0};
    int64_t i = lo;
    for (; i + LANES <= hi; i += LANES) {
        for (int k = 0; k < LANES; k++) {
            float t = s0 ? x0[i + k] * f0 : x0[i + k];
            if (x1) t = t + (s1 ? x1[i + k] * f1 : x1[i + k]);
            float a = init ? t : acc[i + k] + t;
            acc[i + k] = a;
            lane[k] += a * a;
        }
    }
    float ss = 0.0f;
    for (; i < hi; i++) {
        float t = s0 ? x0[i] * f0 : x0[i];
        if (x1) t = t + (s1 ? x1[i] * f1 : x1[i]);
        float a = init ? t : acc[i] + t;
        acc[i] = a;
        ss += a * a;
    }
    for (int k = 0; k < LANES; k++) ss += lane[k];
    return ss;
}
#define VARIANT(NAME, S0, X1, S1, INIT) \
    static float NAME(float *restrict acc, const float *restrict x0, float f0, \
                      const float *restrict x1, float f1, int64_t lo, int64_t hi) \
    { return pass(acc, x0, f0, S0, X1 ? x1 : 0, f1, S1, INIT, lo, hi); }
VARIANT(v0000, 0, 0, 0, 0) VARIANT(v0001, 0, 0, 0, 1)
VARIANT(v0100, 0, 1, 0, 0) VARIANT(v0101, 0, 1, 0, 1)
VARIANT(v0110, 0, 1, 1, 0) VARIANT(v0111, 0, 1, 1, 1)
VARIANT(v1000, 1, 0, 0, 0) VARIANT(v1001, 1, 0, 0, 1)
VARIANT(v1100, 1, 1, 0, 0) VARIANT(v1101, 1, 1, 0, 1)
VARIANT(v1110, 1, 1, 1, 0) VARIANT(v1111, 1, 1, 1, 1)
typedef float (*variant)(float *restrict, const float *restrict, float,
                         const float *restrict, float, int64_t, int64_t);
int64_t meshkit_fold_f32(float *acc, const float *x0, float f0, int s0,
                         const float *x1, float f1, int s1, int64_t lo, int64_t hi,
                         int init, int64_t chunk, int check, int div, float d)
{
    static const variant table[16] = {
        v0000, v0001, v0000, v0001, v0100, v0101, v0110, v0111,
        v1000, v1001, v1000, v1001, v1100, v1101, v1110, v1111};
    variant f = table[(s0 ? 8 : 0) | (x1 ? 4 : 0) | (x1 && s1 ? 2 : 0) | (init ? 1 : 0)];
    for (int64_t start = lo; start < hi; start += chunk) {
        int64_t stop = start + chunk < hi ? start + chunk : hi;
        float ss = f(acc, x0, f0, x1, f1, start, stop);
        if (check && !(ss < INFINITY)) return start;
        if (div) for (int64_t j = start; j < stop; j++) acc[j] = acc[j] / d;
    }
    return -1;
}
"""

#: No fused multiply-add (-ffp-contract=off), no reassociation (no -ffast-math):
#: each operation rounds as numpy's does. -O3 vectorises for the baseline ISA only,
#: so a library in a shared cache runs on every host of its architecture.
FLAGS = ("-O3", "-std=c99", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared")

_lock = threading.Lock()
_loaded: tuple[Any, str] | None = None  # (the function or None, why), once a process


def cache_dir() -> Path:
    """Where compiled kernels are kept (module docstring)."""
    if os.environ.get("MESHKIT_CACHE"):
        return Path(os.environ["MESHKIT_CACHE"]) / "kernels"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "meshkit" / "kernels"


def fold_kernel() -> Any:
    """The compiled ``meshkit_fold_f32`` (a ctypes function), or None: numpy's passes."""
    global _loaded
    if _loaded is None:
        with _lock:
            if _loaded is None:
                _loaded = _load()
                if _loaded[0] is None:
                    log.debug("the fold's C kernel is not used: %s", _loaded[1])
    return _loaded[0]


def status() -> str:
    """One line: whether large float32 folds run the C kernel, and if not, why."""
    function = fold_kernel()
    assert _loaded is not None
    return f"compiled ({_loaded[1]})" if function is not None else f"numpy passes ({_loaded[1]})"


def _compiler() -> list[str] | None:
    chosen = os.environ.get("CC") or "cc"
    argv = chosen.split()
    return argv if argv and shutil.which(argv[0]) else None


def _private(path: Path) -> str | None:
    """Why ``path`` must not be trusted (another user's, or writable by others), or None."""
    info = path.stat()
    if info.st_uid != os.getuid():
        return f"{path} belongs to another user"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by others"
    return None


def _load() -> tuple[Any, str]:
    if os.environ.get("MESHKIT_FOLD_KERNEL", "1").strip() in ("0", "false", "no", "off"):
        return None, "MESHKIT_FOLD_KERNEL=0"
    if os.name != "posix":
        return None, f"no C kernel on {os.name}"
    compiler = _compiler()
    if compiler is None:
        return None, "no C compiler ($CC or cc) on PATH"
    key = hashlib.sha256("\0".join([SOURCE, *FLAGS, *compiler, platform.machine(),
                                    platform.system()]).encode()).hexdigest()[:20]
    try:
        where = cache_dir()
        library = where / f"fold-{key}.so"
        where.mkdir(mode=0o700, parents=True, exist_ok=True)
        why = _private(where)
        if why is None and not library.exists():
            _build(compiler, where, library)
        why = why or _private(library)
        if why is not None:
            return None, why
        function = ctypes.CDLL(str(library)).meshkit_fold_f32
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:  # RuntimeError: no home
        return None, f"could not build or load it ({type(exc).__name__}: {str(exc)[:200]})"
    i64, f32, ptr, cint = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
    function.argtypes = [ptr, ptr, f32, cint, ptr, f32, cint, i64, i64, cint, i64, cint,
                         cint, f32]
    function.restype = i64
    return function, str(library)


def _build(compiler: list[str], where: Path, library: Path) -> None:
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        source = Path(tmp) / "fold.c"
        source.write_text(SOURCE)
        built = Path(tmp) / "fold.so"
        done = subprocess.run([*compiler, *FLAGS, "-o", str(built), str(source)],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise OSError(f"{' '.join(compiler)} exited {done.returncode}: "
                          f"{done.stderr.strip()[:300]}")
        os.chmod(built, 0o700)
        os.replace(built, library)  # atomic: a process starting now sees all or nothing
