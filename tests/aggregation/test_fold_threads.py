"""A large fold is split across threads: same bits, same refusals, really threaded."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import meshkit_aggregators
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from meshkit import AggregationError, ConfigError
from meshkit.aggregation import CHUNK_ELEMENTS, MeanFold, _threads
from meshkit.plugins import build_manager
from meshkit.state import BFLOAT16


def contributions(n, sizes, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return [{f"a{i}": rng.standard_normal(size).astype(dtype) for i, size in enumerate(sizes)}
            for _ in range(n)]


def fold(states, weights, **options):
    folding = MeanFold(**options)
    for i, (state, weight) in enumerate(zip(states, weights)):
        folding.add(state, weight, source=f"rank {i + 1}")
    return folding.result()


@pytest.mark.parametrize("retain", [0, 1, None])
def test_a_large_threaded_fold_equals_one_thread_bit_for_bit(retain):
    # Sizes that are not multiples of the chunk, one array smaller than a
    # chunk, so shares split arrays mid-way and at odd places.
    sizes = [700_001, 3, 450_017, 65_537]
    states = contributions(5, sizes)
    weights = [3.0, 1.0, 7.5, 2.0, 0.25]
    one = fold(states, weights, threads=1, retain=retain)
    for threads in (2, 3):
        many = fold(states, weights, threads=threads, retain=retain)
        for key in one:
            assert many[key].tobytes() == one[key].tobytes(), (threads, key)


def threads_folding(states, weights, **options) -> set[str]:
    """Names of the threads that folded a share while folding ``states``."""
    seen: set[str] = set()
    original = MeanFold._fold_chunks

    def recording(self, *args, **kwargs):
        seen.add(threading.current_thread().name)
        return original(self, *args, **kwargs)

    with mock.patch.object(MeanFold, "_fold_chunks", recording):
        fold(states, weights, **options)
    return seen


def test_the_tasks_run_on_the_fold_threads():
    # The calling thread holds its first task until a fold thread has folded one: both
    # take tasks (a fold of 3 tasks; which thread takes which is the machine's to decide).
    seen: set[str] = set()
    pooled = threading.Event()
    original = MeanFold._fold_chunks
    caller = threading.current_thread().name

    def recording(self, *args, **kwargs):
        name = threading.current_thread().name
        if name == caller and args[2] is False:  # a threaded fold (not the init fold)
            pooled.wait(30)
        try:
            return original(self, *args, **kwargs)
        finally:
            seen.add(name)
            if name.startswith("meshkit-fold"):
                pooled.set()

    with mock.patch.object(MeanFold, "_fold_chunks", recording):
        fold(contributions(3, [3 << 20]), [1.0, 2.0, 3.0], threads=2)
    assert caller in seen
    assert any(name.startswith("meshkit-fold") for name in seen), seen


def test_a_small_fold_stays_on_the_calling_thread():
    seen = threads_folding(contributions(3, [1000]), [1.0, 2.0, 3.0], threads=2)
    assert seen == {threading.current_thread().name}


def test_nan_in_the_second_share_names_its_contributor_and_breaks_the_fold():
    states = contributions(4, [600_000, 600_000])
    states[2]["a1"] = states[2]["a1"].copy()
    states[2]["a1"][-5] = np.nan  # the last array's tail: the second thread's share
    folding = MeanFold(threads=2, retain=1)
    folding.add(states[0], 1.0, source="rank 1")
    folding.add(states[1], 2.0, source="rank 2")
    folding.add(states[2], 3.0, source="rank 3")
    with pytest.raises(AggregationError) as err:
        folding.add(states[3], 4.0, source="rank 4")
    assert "'a1'" in str(err.value) and "rank 3 sent NaN or inf" in str(err.value)
    assert err.value.contributors == ["rank 3"]
    with pytest.raises(AggregationError, match="unusable after a refused contribution"):
        folding.result()


def test_threads_must_be_a_positive_count():
    with pytest.raises(ValueError, match="threads must be an integer >= 1, got 0"):
        MeanFold(threads=0)
    pset = build_manager([meshkit_aggregators], entry_points=False)
    with pytest.raises(ConfigError, match="threads must be an integer from 1 to 64, got 0"):
        pset.create("aggregator", "fedavg", {"threads": 0})
    assert pset.create("aggregator", "allreduce", {"threads": 1}).threads == 1


@settings(max_examples=60, deadline=None)
@given(n=hst.integers(1, 5), size=hst.integers(1, 60), chunk=hst.sampled_from([3, 7, 16]),
       threads=hst.integers(2, 4), retain=hst.sampled_from([0, 1, 2, None]),
       dtype=hst.sampled_from([np.float16, BFLOAT16, np.float32, np.float64]),
       seed=hst.integers(0, 2 ** 16))
def test_any_split_of_any_fold_is_bit_identical(n, size, chunk, threads, retain, dtype, seed):
    # With the size threshold lowered, even tiny folds are split, on chunk
    # boundaries that fall anywhere in the arrays.
    states = contributions(n, [size, max(size // 3, 1)], dtype=dtype, seed=seed)
    weights = list(np.random.default_rng(seed).uniform(0.1, 10, size=n))
    one = fold(states, weights, threads=1, retain=retain, chunk=chunk)
    with mock.patch.object(_threads, "_THREADED_MIN_ELEMENTS", 0):
        many = fold(states, weights, threads=threads, retain=retain, chunk=chunk)
    for key in one:
        assert many[key].dtype == one[key].dtype
        assert many[key].tobytes() == one[key].tobytes()



def test_a_fold_thread_left_unscheduled_leaves_its_tasks_to_the_calling_thread():
    # The fold pool's only thread is busy until the calling thread has folded every task
    # of a threaded fold: the fold does not wait on it (fixed halves did), and its bits
    # are one thread's.
    sizes = [3 << 20, 300_001]
    states = contributions(3, sizes)
    weights = [1.0, 2.0, 3.0]
    one = fold(states, weights, threads=1)
    total = len(_threads.tasks(sizes, CHUNK_ELEMENTS))
    assert total > 2
    released = threading.Event()
    busy = ThreadPoolExecutor(1, thread_name_prefix="busy")
    busy.submit(released.wait, 60)
    seen: list[str] = []
    original = MeanFold._fold_chunks

    def recording(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        finally:
            seen.append(threading.current_thread().name)
            if len(seen) == total:  # every task of the threaded fold is done
                released.set()

    folding = MeanFold(threads=2, retain=1)
    folding.add(states[0], weights[0])
    folding.add(states[1], weights[1])  # the first pair: one thread (init), not watched
    folding.add(states[2], weights[2])
    try:
        with mock.patch.object(MeanFold, "_fold_chunks", recording), \
                mock.patch.object(_threads, "_fold_pool", lambda: busy):
            many = folding.result()  # the last pair, on two threads
    finally:
        released.set()
        busy.shutdown()
    assert seen == [threading.current_thread().name] * total, seen
    for key in one:
        assert many[key].tobytes() == one[key].tobytes()
