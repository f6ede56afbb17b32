"""kill -9 of the service mid-round, three runs in flight: a restart finishes them, bit for bit."""

from __future__ import annotations

import signal
import tomllib
from pathlib import Path

import numpy as np
import pytest

import meshkit
from meshkit.checkpoint import load_checkpoint
from tests.support.service import Federation, run_toml


@pytest.mark.slow
def test_runs_killed_with_the_service_resume_and_end_bit_identical(
        federation: Federation) -> None:
    fed = federation
    fed.start_service()
    for i in range(4):
        fed.start_node(f"n{i}")
    rounds = 60
    configs = [run_toml(fed.root / f"job{i}.toml", workers=w, rounds=rounds, seed=10 + i)
               for i, w in enumerate((2, 1, 1))]
    client = fed.client()
    ids = [client.submit(c.name, c.read_text())["id"] for c in configs]
    for run in ids:
        fed.wait_round(run, 2)
    assert fed.service is not None
    fed.service.signal(signal.SIGKILL)
    assert fed.service.wait() == -signal.SIGKILL

    fed.start_service()  # same state_dir, same ports: the nodes rejoin by themselves
    finals = {run: fed.wait_run(run, timeout=300) for run in ids}
    for run, config in zip(ids, configs):
        assert finals[run]["state"] == "finished", finals[run]
        result = finals[run]["result"]
        assert 2 <= result["resumed_from"] < rounds, result  # it was interrupted and resumed
        served = load_checkpoint(fed.state / "runs" / run / "out")
        reference = meshkit.run({**_tables(config), "run": {
            **_tables(config)["run"], "out": str(fed.root / "reference" / run)}})
        assert reference.ok
        expected = load_checkpoint(fed.root / "reference" / run)
        assert served.round == expected.round == rounds
        assert sorted(served.state) == sorted(expected.state)
        for key in expected.state:
            np.testing.assert_array_equal(np.asarray(served.state[key]),
                                          np.asarray(expected.state[key]), err_msg=key)


def _tables(path: Path) -> dict:
    return tomllib.loads(path.read_text())
