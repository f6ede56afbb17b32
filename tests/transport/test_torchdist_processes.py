"""torchdist with real processes: torchrun launches a data-parallel run; a SIGKILLed rank is lost, not waited for."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch.distributed")

import meshkit.plugins  # noqa: E402
from meshkit import PeerLostError  # noqa: E402
from meshkit.checkpoint import load_checkpoint  # noqa: E402
from meshkit.node.config import NodeConfig  # noqa: E402
from meshkit.train import LocalPool, StrategyContext  # noqa: E402

pytestmark = pytest.mark.slow

CONFIG = """\
[run]
task = "digits"
seed = 3
out = "{out}"

[mesh]
transport = "torchdist"
workers = 2
timeout = 20

[strategy]
name = "data-parallel"
rounds = 2
steps = 3
batch_size = 16

[aggregator]
name = "allreduce"
"""


def _torchrun() -> str:
    found = Path(sys.executable).with_name("torchrun")
    return str(found) if found.exists() else (shutil.which("torchrun") or "torchrun")


def _star_model() -> dict:
    """The same run on in-process replicas whose gradients rank 0 folds (the star's path)."""
    task = lambda: meshkit.plugins.create("task", "digits")  # noqa: E731
    ctx = StrategyContext(task=task(), aggregator=meshkit.plugins.create("aggregator", "allreduce"),
                          pool=LocalPool.of(task, [1, 2]), workers=[1, 2],
                          rng=np.random.default_rng(0), seed=3, timeout=20)
    strategy = meshkit.plugins.create("strategy", "data-parallel",
                                      {"rounds": 2, "steps": 3, "batch_size": 16})
    return dict(strategy.run(ctx).state)


def test_torchrun_launches_a_data_parallel_run_that_reaches_the_stars_model(tmp_path) -> None:
    out = tmp_path / "run"
    config = tmp_path / "dp.toml"
    config.write_text(CONFIG.format(out=out))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("MESHKIT_SECRET", None)
    done = subprocess.run(
        [_torchrun(), "--standalone", "--nproc-per-node", "3", "-m", "meshkit_torchdist",
         str(config)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 0: run finished: 2/2 round(s)" in done.stdout, done.stdout
    # Progress as `meshkit run` prints it, not only the final line.
    assert "round   1/2  workers 2/2  train_loss " in done.stdout, done.stdout
    assert "round   2/2  workers 2/2  train_loss " in done.stdout, done.stdout
    checkpoint = load_checkpoint(out)
    assert checkpoint.round == 2
    want = _star_model()
    for key, value in want.items():
        np.testing.assert_allclose(checkpoint.state[key], value, rtol=1e-5, atol=1e-6,
                                   err_msg=key)


RANK_2 = textwrap.dedent("""
    import sys, time
    import meshkit.plugins
    from meshkit.node.config import NodeConfig
    import numpy as np
    group = meshkit.plugins.create("transport", "torchdist").connect(NodeConfig(
        rank=2, world=3, peers=[sys.argv[1]], transport="torchdist", timeout=5))
    group.mesh_all_reduce({"x": np.ones(8, np.float32)}, ranks=[1, 2])  # the group forms
    print("joined", flush=True)
    time.sleep(120)  # until SIGKILLed
""")


def test_a_sigkilled_rank_is_a_peer_lost_error_on_every_rank_not_a_hang() -> None:
    transport = meshkit.plugins.create("transport", "torchdist")
    coordinator = transport.connect(NodeConfig(rank=0, world=3, bind="127.0.0.1:0",
                                               transport="torchdist", timeout=5))
    victim = subprocess.Popen([sys.executable, "-c", RANK_2, coordinator.address],
                              stdout=subprocess.PIPE, text=True)
    outcome: dict = {}
    try:
        worker = transport.connect(NodeConfig(rank=1, world=3, peers=[coordinator.address],
                                              transport="torchdist", timeout=5))
        # Together once, so the loss hits a formed collective, not its rendezvous.
        worker.mesh_all_reduce({"x": np.ones(8, np.float32)}, ranks=[1, 2])
        assert victim.stdout.readline().strip() == "joined"
        assert coordinator.wait_for_workers(10) == [1, 2]

        def all_reduce() -> None:
            try:
                outcome["value"] = worker.mesh_all_reduce({"x": np.ones(8, np.float32)},
                                                          ranks=[1, 2])
            except BaseException as exc:  # checked below
                outcome["error"] = exc

        thread = threading.Thread(target=all_reduce, daemon=True)
        thread.start()
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(10)
        thread.join(20)  # bounded: the collective's own timeout is 5 s
        assert not thread.is_alive(), "the all-reduce with a killed rank hung"
        assert isinstance(outcome.get("error"), PeerLostError), outcome
        with pytest.raises(PeerLostError, match="rank 2"):
            coordinator.recv(2, 7, timeout=20)
        assert 2 in coordinator.dead and "broke" in coordinator.dead[2]
        worker.close()
    finally:
        if victim.poll() is None:
            victim.kill()
        coordinator.close()
