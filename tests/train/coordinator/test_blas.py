"""A local launch's coordinator runs OpenBLAS on one thread while its workers run (a woken
pool spins a core away between rounds) and gets its pool back after, unless the user chose a
count. Each check runs in its own process: OpenBLAS's count is process-wide and read from the
environment when numpy loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from meshkit.train._coordinator.blas import USER_CHOICE, blas_threads

pytestmark = pytest.mark.slow


def threads_in_a_fresh_process(body: str, **env: str) -> dict:
    """Run ``body`` in a new interpreter (no user thread count unless given): OpenBLAS's count
    before and after it, and what it printed last as a JSON list ("during")."""
    clean = {k: v for k, v in os.environ.items() if k not in USER_CHOICE}
    script = textwrap.dedent("""
        import json
        from meshkit.train._coordinator.blas import blas_threads
        before = blas_threads()
    """) + textwrap.dedent(body) + textwrap.dedent("""
        print(json.dumps({'before': before, 'after': blas_threads()}))
    """)
    done = subprocess.run([sys.executable, "-c", script], env={**clean, **env}, timeout=120,
                          capture_output=True, text=True, check=True)
    *printed, last = done.stdout.strip().splitlines()
    seen = json.loads(last)
    if printed and printed[-1].startswith("["):
        seen["during"] = json.loads(printed[-1])
    return seen


@pytest.fixture(scope="module")
def pool() -> int:
    """OpenBLAS's thread count in a fresh process; skips where one thread is all there is."""
    if blas_threads() is None:
        pytest.skip("numpy's BLAS here is not an OpenBLAS this process can find")
    before = threads_in_a_fresh_process("")["before"]
    if before < 2:
        pytest.skip("OpenBLAS runs one thread here already (one core)")
    return before


def test_a_local_launch_runs_the_coordinators_blas_on_one_thread_and_gives_the_pool_back(
        pool, tmp_path):
    seen = threads_in_a_fresh_process(f"""
        from meshkit.train import Runner
        during = []
        report = Runner({{"run": {{"out": {str(tmp_path / 'out')!r}, "seed": 3}},
                         "mesh": {{"workers": 1, "timeout": 30.0}},
                         "strategy": {{"rounds": 2}}}},
                        on_round=lambda report, state: during.append(blas_threads())).run()
        assert report.ok, report
        print(json.dumps(during))
    """)
    assert seen["during"] == [1, 1]
    assert (seen["before"], seen["after"]) == (pool, pool)


def test_a_thread_count_the_user_chose_is_left_alone(pool):
    seen = threads_in_a_fresh_process("""
        from meshkit.train._coordinator.blas import give_back, share_cores
        assert share_cores(owner := object()) == 2
        give_back(owner)
    """, OPENBLAS_NUM_THREADS="2")
    assert seen == {"before": 2, "after": 2}


def test_the_pool_is_given_back_even_when_a_worker_cannot_be_reaped(pool):
    # A worker that outlives terminate and kill (stuck in the kernel): reap raises, and
    # the coordinator's BLAS pool must still be its own again.
    seen = threads_in_a_fresh_process("""
        import subprocess
        from meshkit.train._coordinator.blas import share_cores
        from meshkit.train._coordinator.launch import reap

        class Stuck:
            def poll(self): return None
            def wait(self, timeout=None): raise subprocess.TimeoutExpired("worker", timeout)
            def terminate(self): pass
            def kill(self): pass

        processes = {1: Stuck()}
        assert share_cores(processes) == 1
        try:
            reap(processes, grace=0.0)
        except subprocess.TimeoutExpired:
            pass
        else:
            raise AssertionError("reap should have raised")
    """)
    assert (seen["before"], seen["after"]) == (pool, pool)
