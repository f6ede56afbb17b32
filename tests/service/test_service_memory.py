"""``meshkit serve``'s memory stays flat over many small runs (issue 40).

The service runs in this process, so tracemalloc sees everything it
allocates; its nodes are real ``meshkit node --service`` processes. The
automatic cycle collector is off while the runs go: a run's objects hold
reference cycles, and whether the collector happened to run just before a
measurement must not decide the test. What is measured is the service's own
promise (meshkit/service/_runs.py, "Memory"): a run reported ended holds no
memory.
"""

from __future__ import annotations

import gc
import json
import time
import tracemalloc
from pathlib import Path
from typing import Iterator

import pytest

from meshkit.service import ServeConfig, Service
from tests.support.service import DEADLINE, Proc

#: Small runs, measured after the first quarter and after the last
#: (benchmarks/serve.py measures 1,000 rounds the same way).
RUNS, ROUNDS = 20, 5
#: Traced bytes a run may leave behind, on average. A digits run's data alone
#: (its task's training and test arrays) is about 920 kB, and before the
#: service collected each ended run it left about 500 kB a run behind.
PER_RUN = 20_000

CONFIG = """
[run]
task = "digits"
seed = {seed}

[mesh]
workers = 2

[strategy]
name = "federated"
rounds = {rounds}

[aggregator]
name = "fedavg"

[task]
hidden = 8
"""


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    svc = Service(ServeConfig(state_dir=str(tmp_path / "state")))
    svc.start()
    nodes: list[Proc] = []
    try:
        for i in range(2):
            node = Proc(["node", "--service", svc.node_address, "--secret-file",
                         str(svc.state / "nodes.secret")], cwd=tmp_path, name=f"node{i}")
            nodes.append(node)
            node.wait_for(lambda x: isinstance(x, dict) and x.get("event") == "joined")
        yield svc
    finally:
        for node in nodes:
            node.close()
        svc.close()


def _run(service: Service, seed: int) -> None:
    """Submit one run and wait until it is reported ended (finished, else the test fails)."""
    assert service.store is not None
    run = service.submit("small.toml", CONFIG.format(seed=seed, rounds=ROUNDS)).id
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        service.store.wait_events(run, after=10**9, timeout=5)
        record = service.store.run(run)
        if record is not None and record.state not in ("queued", "running", "stopping"):
            assert record.state == "finished", json.dumps(record.error)
            assert record.rounds_completed == ROUNDS
            return
    raise AssertionError(f"run {run} did not end within {DEADLINE} s")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_services_memory_is_flat_over_many_small_runs(
        service: Service) -> None:
    quarter = RUNS // 4
    was_enabled = gc.isenabled()
    tracemalloc.start()
    gc.disable()
    try:
        for i in range(RUNS):
            _run(service, seed=i)
            if i + 1 == quarter:
                after_quarter = tracemalloc.get_traced_memory()[0]
        after_all = tracemalloc.get_traced_memory()[0]
    finally:
        if was_enabled:
            gc.enable()
        tracemalloc.stop()
    per_run = (after_all - after_quarter) / (RUNS - quarter)
    assert per_run < PER_RUN, (
        f"the service grew by {per_run / 1e3:.1f} kB a run over {RUNS - quarter} runs of "
        f"{ROUNDS} rounds ({after_quarter / 1e6:.2f} MB after {quarter} runs, "
        f"{after_all / 1e6:.2f} MB after {RUNS})")
