"""A local launch's coordinator runs OpenBLAS on one thread (a woken pool spins a core away
between rounds), unless the user chose a thread count. Each check runs in its own process:
OpenBLAS's count is process-wide and read from the environment when numpy loads."""

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
    """Run ``body`` in a new interpreter (no user thread count unless given); its last line is JSON."""
    clean = {k: v for k, v in os.environ.items() if k not in USER_CHOICE}
    script = textwrap.dedent("""
        import json
        from meshkit.train._coordinator.blas import blas_threads
        before = blas_threads()
    """) + textwrap.dedent(body) + "\nprint(json.dumps({'before': before, 'after': blas_threads()}))\n"
    done = subprocess.run([sys.executable, "-c", script], env={**clean, **env}, timeout=120,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def pool() -> int:
    """OpenBLAS's thread count in a fresh process; skips where one thread is all there is."""
    if blas_threads() is None:
        pytest.skip("numpy's BLAS here is not an OpenBLAS this process can find")
    before = threads_in_a_fresh_process("")["before"]
    if before < 2:
        pytest.skip("OpenBLAS runs one thread here already (one core)")
    return before


def test_a_local_launch_cuts_the_coordinators_blas_pool_to_one_thread(pool, tmp_path):
    seen = threads_in_a_fresh_process(f"""
        import meshkit
        report = meshkit.run({{"run": {{"out": {str(tmp_path / 'out')!r}, "seed": 3}},
                              "mesh": {{"workers": 1, "timeout": 30.0}},
                              "strategy": {{"rounds": 1}}}})
        assert report.ok, report
    """)
    assert seen == {"before": pool, "after": 1}


def test_a_thread_count_the_user_chose_is_left_alone(pool):
    seen = threads_in_a_fresh_process("""
        from meshkit.train._coordinator.blas import share_cores
        assert share_cores() == 2
    """, OPENBLAS_NUM_THREADS="2")
    assert seen == {"before": 2, "after": 2}
