"""The fold's C kernel (meshkit/aggregation/_kernel.py): the formula's bits and the same
refusals as numpy's passes, and numpy's passes wherever it is not built or not trusted.

The kernel is compiled for real with this machine's C compiler (into the user's cache, or
a temporary one); where there is none, the tests that need it are skipped, and the fold
keeps numpy's passes (tested in test_fold_bits.py).
"""

from __future__ import annotations

import os
import shutil
import stat
from contextlib import contextmanager, nullcontext
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from meshkit.aggregation import MeanFold, _kernel, _mean, _threads
from meshkit.errors import AggregationError
from tests.aggregation.test_fold_bits import inputs, reference

needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc").split()[0]) is None,
                              reason="no C compiler: the fold keeps numpy's passes")


class Counted:
    """The kernel, counting its calls (so a test of its bits cannot pass on numpy's)."""

    def __init__(self, function):
        self.function, self.calls = function, 0

    def __call__(self, *args):
        self.calls += 1
        return self.function(*args)


@contextmanager
def kernel_on():
    """Every fold takes the kernel where it applies (not only folds of 1M elements),
    counted, on as many threads as it asks for."""
    function = _kernel.fold_kernel()
    assert function is not None, _kernel.status()
    counted = Counted(function)
    with mock.patch.object(_mean, "fold_kernel", lambda: counted), \
            mock.patch.object(_mean, "KERNEL_MIN_ELEMENTS", 0), \
            mock.patch.object(_threads, "_THREADED_MIN_ELEMENTS", 0):
        yield counted


@pytest.fixture
def kernel():
    with kernel_on() as counted:
        yield counted


def fold(arrays, weights, *, passes: bool = False, **options):
    """MeanFold's result; ``passes``: with numpy's passes only (no kernel)."""
    folding = MeanFold(**options)
    with mock.patch.object(_mean, "fold_kernel", lambda: None) if passes else nullcontext():
        for i, (x, w) in enumerate(zip(arrays, weights)):
            folding.add({"x": x}, w, source=f"c{i}")
        return folding.result()["x"]


@needs_cc
@settings(max_examples=150, deadline=None)
@given(n=hst.integers(1, 7), size=hst.integers(1, 300),
       chunk=hst.sampled_from([1, 7, 16, 33, 1 << 16]), threads=hst.integers(1, 3),
       retain=hst.sampled_from([0, 1, 2, None]), weighted=hst.booleans(),
       equal=hst.booleans(), seed=hst.integers(0, 2 ** 16))
def test_the_kernel_is_the_formula_bit_for_bit(n, size, chunk, threads, retain, weighted,
                                               equal, seed):
    arrays, weights = inputs(seed, n, size, np.float32, weighted=weighted, equal=equal)
    with kernel_on() as counted:
        got = fold(arrays, weights, weighted=weighted, retain=retain, chunk=chunk,
                   threads=threads)
    want = reference(arrays, weights, weighted=weighted, retain=retain)
    assert got.tobytes() == want.tobytes()
    if n > 1 and retain in (0, 1):
        assert counted.calls, "the kernel folded nothing: this compared numpy with numpy"


@needs_cc
def test_a_large_fold_takes_the_kernel_by_default_and_gives_the_passes_bits():
    rng = np.random.default_rng(5)
    size = _kernel.MIN_ELEMENTS + 12_345  # odd: tails of lanes, chunks and tasks
    arrays = [rng.standard_normal(size, dtype=np.float32) for _ in range(5)]
    weights = [3.0, 1.0, 7.5, 2.0, 11.0]
    function = _kernel.fold_kernel()
    assert function is not None, _kernel.status()
    counted = Counted(function)
    with mock.patch.object(_mean, "fold_kernel", lambda: counted):
        got = fold(arrays, weights)
    assert counted.calls >= 2  # (the calling thread and the fold's other thread)
    assert got.tobytes() == fold(arrays, weights, passes=True).tobytes()
    assert got.tobytes() == reference(arrays, weights, weighted=True, retain=1).tobytes()


@needs_cc
@pytest.mark.parametrize("bad, why", [(np.nan, "NaN or inf"), (np.inf, "NaN or inf"),
                                      (1e30, "out of range")])
@pytest.mark.parametrize("count", [2, 3, 4])  # a pair, a pair then the last (divided), two pairs
def test_the_kernel_refuses_what_the_passes_refuse(kernel, bad, why, count):
    rng = np.random.default_rng(count)
    arrays = [rng.standard_normal(1000).astype(np.float32) for _ in range(count)]
    arrays[-1][777] = bad
    weights = [1.0, 2.0, 3.0, 4.0][:count]
    with pytest.raises(AggregationError, match=why) as passes:
        fold(arrays, weights, passes=True, chunk=100)
    calls = kernel.calls
    with pytest.raises(AggregationError, match=why) as fused:
        fold(arrays, weights, chunk=100)
    assert kernel.calls > calls
    assert str(fused.value) == str(passes.value)
    assert fused.value.contributors == passes.value.contributors == [f"c{count - 1}"]


@needs_cc
@pytest.mark.parametrize("count", [2, 3])  # the last fold without and with the divide
def test_a_false_alarm_is_told_apart_and_the_chunk_still_divided(kernel, count):
    # Values in range whose squares overflow float32 together: the chunk's check
    # alarms, the element-by-element look finds nothing wrong, the fold goes on.
    arrays = [np.full(64, 1.5e19, dtype=np.float32) for _ in range(count)]
    arrays[0][5] = -2.0
    weights = [1.0, 0.25, 0.5][:count]
    got = fold(arrays, weights, chunk=16)
    assert kernel.calls
    want = fold(arrays, weights, passes=True, chunk=16)
    assert got.tobytes() == want.tobytes()
    assert got.tobytes() == reference(arrays, weights, weighted=True, retain=1).tobytes()


@needs_cc
def test_let_through_non_finite_values_keep_the_passes_bits(kernel):
    arrays = [np.linspace(-1, 1, 500, dtype=np.float32) for _ in range(4)]
    arrays[1][3], arrays[2][4], arrays[3][3] = np.nan, np.inf, -np.inf
    weights = [1.0, 2.0, 0.5, 4.0]
    got = fold(arrays, weights, allow_nonfinite=True, chunk=64)
    assert kernel.calls
    assert got.tobytes() == fold(arrays, weights, passes=True, allow_nonfinite=True,
                                 chunk=64).tobytes()


# -- building and trusting the library ------------------------------------------------------


def test_the_kernel_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("MESHKIT_FOLD_KERNEL", "0")
    assert _kernel._load() == (None, "MESHKIT_FOLD_KERNEL=0")


def test_no_compiler_means_numpy_passes(monkeypatch, tmp_path):
    monkeypatch.setenv("MESHKIT_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    function, why = _kernel._load()
    assert function is None and "no C compiler" in why


def test_a_failed_build_means_numpy_passes(monkeypatch, tmp_path):
    monkeypatch.setenv("MESHKIT_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", shutil.which("false") or "false")
    function, why = _kernel._load()
    assert function is None and "could not build" in why and "exited" in why
    assert not list((tmp_path / "kernels").glob("*.so"))


@needs_cc
def test_a_fresh_cache_builds_a_private_library_once(monkeypatch, tmp_path):
    monkeypatch.setenv("MESHKIT_CACHE", str(tmp_path))
    function, where = _kernel._load()
    assert function is not None, where
    library = Path(where)
    assert library.parent == tmp_path / "kernels"
    assert stat.S_IMODE(library.parent.stat().st_mode) == 0o700
    assert not stat.S_IMODE(library.stat().st_mode) & 0o077
    built = library.stat().st_mtime_ns
    again, where_again = _kernel._load()
    assert again is not None and where_again == where
    assert library.stat().st_mtime_ns == built, "the cached library was built again"
    assert [p.name for p in library.parent.iterdir()] == [library.name], "no temporary left"


@needs_cc
def test_a_library_others_may_write_is_not_loaded(monkeypatch, tmp_path):
    monkeypatch.setenv("MESHKIT_CACHE", str(tmp_path))
    function, where = _kernel._load()
    assert function is not None, where
    os.chmod(where, 0o722)  # anyone could have replaced it: it could run any code here
    function, why = _kernel._load()
    assert function is None and "writable by others" in why
    os.chmod(where, 0o700)
    os.chmod(tmp_path / "kernels", 0o777)
    function, why = _kernel._load()
    assert function is None and "writable by others" in why


def test_no_home_and_no_cache_dir_means_numpy_passes(monkeypatch):
    monkeypatch.delenv("MESHKIT_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def nowhere():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(_kernel.Path, "home", staticmethod(nowhere))
    function, why = _kernel._load()
    assert function is None and "home directory" in why
