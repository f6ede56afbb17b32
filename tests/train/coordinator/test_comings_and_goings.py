"""Comings and goings over real processes: a restarted worker rejoins, a late one is admitted,
and ``meshkit node`` says how its run ended in its exit status."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from meshkit.train import Runner, read_metrics

from tests.support.configs import external_config, write_config, write_secret_file
pytestmark = pytest.mark.slow

SECRET = b"comings-and-goings-secret-0123456789"


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "MESHKIT_SECRET"}


class Node:
    """A ``meshkit node`` process whose JSON stdout lines are read on a thread."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=_env())
        self.lines: queue.Queue[dict] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self._stderr = threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr),
                                        daemon=True)
        self._stderr.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.put(json.loads(line))

    def joined(self, timeout: float = 60.0) -> dict:
        """Block until the node printed its caps line (it is connected), bounded."""
        while True:
            event = self.lines.get(timeout=timeout)
            if event["event"] == "caps":
                return event["caps"]

    def wait(self, timeout: float = 60.0) -> int:
        """The exit status, once the process ended and its stderr is read to the end."""
        status = self.proc.wait(timeout)
        self._stderr.join(timeout)
        return status

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def node_args(rank: int, world: int, address: str, secret_file: Path) -> list[str]:
    return [sys.executable, "-m", "meshkit", "node", "--rank", str(rank), "--world",
            str(world), "--peers", address, "--topology", "star", "--timeout", "20",
            "--secret-file", str(secret_file)]


@pytest.mark.parametrize("relays", [0, 1], ids=["direct", "behind-a-relay"])
def test_a_worker_killed_after_round_1_and_restarted_with_its_rank_answers_again(tmp_path,
                                                                                 relays):
    procs: dict[int, subprocess.Popen] = {}
    restarted: list[Node] = []

    def on_round(report, state):
        if report.round == 1:
            procs[1].kill()  # SIGKILL
            procs[1].wait(10)
            # The same command line: same rank, same secret file.
            restarted.append(Node(list(procs[1].args)))
        if report.round == 2:
            restarted[0].joined()  # connected: taken back before round 3

    out = tmp_path / "out"
    # With a relay, the restarted node dials the relay again (its --peers), and
    # the relay takes it in and tells the coordinator.
    config = write_config(tmp_path / "c.toml", out, workers=2, rounds=5, timeout=20,
                          extra="clients = 2", mesh=f"relays = {relays}")
    try:
        report = Runner(str(config), on_workers=procs.update, on_round=on_round).run()
        status = restarted[0].wait()
    finally:
        for node in restarted:
            node.kill()
    assert report.ok
    rows = read_metrics(out)
    assert [r["round"] for r in rows] == [1, 2, 3, 4, 5]
    assert 1 in rows[0]["answered"]
    # The gap: round 2 went on without rank 1; a later round took it back.
    assert rows[1]["answered"] == [2] and rows[1]["dropped"] == [1]
    # Directly, the node is connected to the coordinator when it prints its caps,
    # so round 3 takes it back. Behind a relay, the relay tells the coordinator
    # after the node connected to it: under load that message can land after
    # round 3 started, and then a later round takes the rank back, once.
    back = [r["round"] for r in rows if r["joined"] == [1]]
    assert back == [3] if relays == 0 else back in ([3], [4], [5]), rows
    for r in rows[1:]:
        if r["round"] < back[0]:
            assert 1 not in r["answered"]
        else:
            assert 1 in r["answered"]
    assert all(sorted(map(int, r["served"])) == [0, 1] for r in rows)
    # Its run finished: the restarted node exits 0.
    assert status == 0, "".join(restarted[0].stderr)


def test_a_late_worker_is_admitted_at_the_next_round(tmp_path):
    out = tmp_path / "out"
    config = external_config(tmp_path, workers=2, rounds=3, secret=SECRET,
                             mesh="min_workers = 1", extra="clients = 2")
    secret_file = tmp_path / "secret"
    address: queue.Queue[str] = queue.Queue()
    nodes: list[Node] = []

    def progress(event):
        if event.kind == "listening":
            address.put(event.message.split(" on ")[1].split(" ")[0])

    def on_round(report, state):
        if report.round == 1:
            late = Node(node_args(2, 3, where, secret_file))
            nodes.append(late)
            late.joined()

    result: dict = {}
    runner = Runner(str(config), progress=progress, on_round=on_round)
    thread = threading.Thread(target=lambda: result.setdefault("report", runner.run()),
                              daemon=True)
    thread.start()
    try:
        where = address.get(timeout=60)
        nodes.append(Node(node_args(1, 3, where, secret_file)))
        thread.join(120)
        assert not thread.is_alive(), "the run did not finish"
        statuses = [n.wait() for n in nodes]
    finally:
        runner.stop.set()
        for node in nodes:
            node.kill()
    assert result["report"].ok
    rows = read_metrics(out)
    assert rows[0]["answered"] == [1] and rows[0]["joined"] == []
    assert rows[1]["joined"] == [2] and rows[1]["answered"] == [1, 2]
    assert rows[2]["answered"] == [1, 2]
    # Two clients from the start (one per configured worker), late rank or not.
    assert all(sorted(map(int, r["served"])) == [0, 1] for r in rows)
    assert statuses == [0, 0], ["".join(n.stderr) for n in nodes]


COORDINATOR = textwrap.dedent("""
    import sys
    from meshkit import NodeConfig
    from meshkit.node import collect_caps, send_job
    group = NodeConfig(rank=0, world=2, topology="star", bind="127.0.0.1:0", transport="tcp",
                       secret=open(sys.argv[1], "rb").read().strip(), timeout=20).connect()
    print(group.address, flush=True)
    collect_caps(group, hook=False, timeout=60)
    send_job(group, 1, {"kind": "train", "job": 1, "spec": {"task": "digits", "seed": 0}})
    print("job sent", flush=True)
    sys.stdin.read()  # until killed
""")


def test_a_node_whose_coordinator_is_sigkilled_exits_2(tmp_path):
    secret_file = write_secret_file(tmp_path / "secret", SECRET)
    coordinator = subprocess.Popen([sys.executable, "-c", COORDINATOR, str(secret_file)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                   env=_env())
    node = None
    try:
        address = coordinator.stdout.readline().strip()
        node = Node(node_args(1, 2, address, secret_file))
        node.joined()
        assert coordinator.stdout.readline().strip() == "job sent"
        coordinator.kill()  # SIGKILL: no shutdown, no goodbye
        coordinator.wait(10)
        status = node.wait()
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
        if node is not None:
            node.kill()
    assert status == 2
    assert "lost the coordinator before it ended the run; start the node again" in "".join(
        node.stderr)
    assert "Traceback" not in "".join(node.stderr)
