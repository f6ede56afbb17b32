"""Node-local data over real processes: each node trains on a CSV file of its own.

The coordinator's ``[task]`` points at files that do not exist, so its
process cannot read any training or held-out image; two ``meshkit node``
workers each get their own files with ``--task-option``. With ``[partitioner]
name = "local"`` and ``[strategy] evaluate = "clients"`` the run trains and
evaluates only on the nodes, and each node's client count of examples is its
CSV's rows.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshkit.train import Runner, read_metrics

pytestmark = pytest.mark.slow


def _write_csv(path: Path, rows: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
    table = np.column_stack([x[rows], y[rows]])
    np.savetxt(path, table, delimiter=",", fmt="%g")


def _node(rank: int, peers: str, secret: Path, *extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "MESHKIT_SECRET"}
    return subprocess.Popen(
        [sys.executable, "-m", "meshkit", "node", "--rank", str(rank), "--world", "3",
         "--peers", peers, "--secret-file", str(secret), "--timeout", "20", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _run_with_nodes(config: Path, secret: Path, node_flags: dict[int, list[str]]) -> None:
    """Run ``config`` in this process while ``meshkit node`` processes serve it."""
    listening: list[str] = []
    ready = threading.Event()
    outcome: dict[str, Any] = {}

    def progress(event: Any) -> None:
        if event.kind == "listening":
            listening.append(event.message.split()[3])
            ready.set()

    def drive() -> None:
        try:
            outcome["report"] = Runner(str(config), progress=progress).run()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            outcome["error"] = exc
        ready.set()

    coordinator = threading.Thread(target=drive, daemon=True)
    coordinator.start()
    assert ready.wait(60), "the coordinator never started listening"
    assert listening, outcome.get("error")
    procs = [_node(rank, listening[0], secret, *flags) for rank, flags in node_flags.items()]
    try:
        coordinator.join(120)
        assert not coordinator.is_alive(), "the run did not finish"
        for proc in procs:
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    if "error" in outcome:
        raise outcome["error"]


def _secret(tmp_path: Path) -> Path:
    secret = tmp_path / "secret"
    secret.write_text("node-local-data-secret-0123456789")
    secret.chmod(0o600)
    return secret


def test_each_node_trains_and_evaluates_on_its_own_csv(tmp_path):
    from meshkit_tasks.digits import load_digits

    x, y = load_digits()
    order = np.random.default_rng(0).permutation(len(y))
    sizes = {1: (300, 80), 2: (200, 60)}
    files: dict[int, tuple[Path, Path]] = {}
    start = 0
    for rank, (n_train, n_test) in sizes.items():
        node_dir = tmp_path / f"node{rank}"
        node_dir.mkdir()
        train, test = node_dir / "train.csv", node_dir / "test.csv"
        _write_csv(train, order[start:start + n_train], x, y)
        _write_csv(test, order[start + n_train:start + n_train + n_test], x, y)
        start += n_train + n_test
        files[rank] = (train, test)
    secret = _secret(tmp_path)
    config = tmp_path / "run.toml"
    config.write_text(f"""
[run]
task = "digits"
out = "{tmp_path / 'out'}"

[mesh]
launch = "external"
workers = 2
secret_file = "{secret}"
timeout = 20
join_timeout = 60

[strategy]
name = "federated"
rounds = 2
evaluate = "clients"

[partitioner]
name = "local"

[task]
train_csv = "{tmp_path / 'nowhere' / 'train.csv'}"
test_csv = "{tmp_path / 'nowhere' / 'test.csv'}"
""")
    _run_with_nodes(config, secret, {
        rank: ["--task-option", f"train_csv={train}", "--task-option", f"test_csv={test}"]
        for rank, (train, test) in files.items()})
    lines = read_metrics(tmp_path / "out")
    assert [line["round"] for line in lines] == [1, 2]
    for line in lines:
        # Client c is worker c + 1, trained on exactly its own CSV's rows (epochs = 1).
        assert line["served"] == {"0": 1, "1": 2}
        assert line["client_examples"] == {"0": 300, "1": 200}
        held = {c: m["examples"] for c, m in line["client_metrics"].items()}
        assert held == {"0": 80.0, "1": 60.0}
        accuracies = [line["client_metrics"][c]["accuracy"] for c in ("0", "1")]
        mean = (80 * accuracies[0] + 60 * accuracies[1]) / 140
        assert line["client_accuracy"] == pytest.approx(mean)
        assert "accuracy" not in line  # the coordinator evaluated nothing


def test_a_node_without_storage_is_sent_the_training_set(tmp_path):
    # Its own train_csv points nowhere: had it read its own data, its fit would fail.
    secret = _secret(tmp_path)
    config = tmp_path / "run.toml"
    config.write_text(f"""
[run]
task = "digits"
out = "{tmp_path / 'out'}"

[mesh]
launch = "external"
workers = 2
secret_file = "{secret}"
timeout = 20

[strategy]
name = "federated"
rounds = 1
clients = 4

[partitioner]
name = "iid"
""")
    _run_with_nodes(config, secret, {
        1: [], 2: ["--pull-data", "--task-option", f"train_csv={tmp_path / 'none.csv'}"]})
    (line,) = read_metrics(tmp_path / "out")
    # A worker always serves the first client planned for it (only later ones
    # may move to a faster worker), so rank 2 trained on what it was sent.
    assert 2 in line["served"].values()
    assert sum(line["client_examples"].values()) == 1438  # every training row, once
