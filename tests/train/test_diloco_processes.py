"""``diloco`` over real processes: one of four replicas SIGKILLed mid-exchange, the run
finishes without ``--resume``, and a replacement started later heals from a live peer and
holds the others' model, digest for digest, at the next outer step."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from meshkit.train import Runner, read_metrics

from tests.train.coordinator.test_comings_and_goings import Node

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
H = 5  # inner steps an outer step


@pytest.fixture(autouse=True)
def _importable(monkeypatch):
    # The nodes import the stalling task by module reference, as a user's would.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))


def config(tmp_path: Path, claim: Path) -> Path:
    path = tmp_path / "diloco.toml"
    path.write_text(f"""
[run]
task = "tests.support.stalling_task:Stalling"
seed = 11
out = "{tmp_path / 'out'}"

[task]
stall_at = {2 * H}
claim = "{claim}"

[mesh]
launch = "local"
workers = 4
timeout = 30

[strategy]
name = "diloco"
rounds = 4
inner_steps = {H}
outer_bits = 8
quorum = 3
batch_size = 16
inner_timeout = 120

[outer_optimizer]
name = "nesterov"
""")
    return path


def test_a_replica_sigkilled_mid_exchange_is_dropped_and_its_replacement_heals(tmp_path):
    claim = tmp_path / "stall"
    fifo = Path(str(claim) + ".fifo")
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # before any replica can stall
    procs: dict[int, subprocess.Popen] = {}
    killed: dict[str, int] = {}
    replacement: list[Node] = []

    def kill_the_staller() -> None:
        # A replica stalls at its last inner step of outer step 2 and says so: the
        # others' pseudo-gradients are in flight when it is killed.
        ready, _, _ = select.select([reader], [], [], 120)
        if not ready:
            return  # the assertions below say no replica was killed
        pid = int(os.read(reader, 64).decode().split()[0])
        killed["rank"] = next(r for r, p in procs.items() if p.pid == pid)
        os.kill(pid, signal.SIGKILL)

    def on_round(report, state):
        if report.round == 2:
            # The same command line: same rank, same secret. Taken in at round 3.
            node = Node(list(procs[killed["rank"]].args))
            replacement.append(node)
            node.joined()

    watcher = threading.Thread(target=kill_the_staller, daemon=True)
    watcher.start()
    try:
        report = Runner(str(config(tmp_path, claim)), on_workers=procs.update,
                        on_round=on_round).run()
        status = replacement[0].wait()
    finally:
        watcher.join(130)
        os.close(reader)
        for node in replacement:
            node.kill()
    assert report.ok, report.error
    rows = read_metrics(tmp_path / "out")
    victim = killed["rank"]
    others = [r for r in (1, 2, 3, 4) if r != victim]
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["answered"] == [1, 2, 3, 4]
    # Outer step 2 went on with the three whose pseudo-gradients arrived.
    assert rows[1]["answered"] == others and rows[1]["dropped"] == [victim]
    # Outer step 3: the replacement joined, healed from a live peer, and the digest of
    # its model equals every other replica's and the coordinator's global model.
    third = rows[2]
    assert third["joined"] == [victim] and third["answered"] == [1, 2, 3, 4]
    assert third["healed"] == 1 and not third.get("failed")
    digests = {r: third[f"digest_rank{r}"] for r in (1, 2, 3, 4)}
    assert set(digests.values()) == {rows[1]["model_digest"]}, digests
    assert rows[3]["answered"] == [1, 2, 3, 4]
    assert rows[3]["loss"] < rows[0]["loss"]
    assert status == 0, "".join(replacement[0].stderr)
