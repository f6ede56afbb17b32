"""Node-local data over real processes: each node trains on a CSV file of its own.

The coordinator's ``[task]`` points at files that do not exist, so its
process cannot read any training or held-out image; two ``meshkit node``
workers each get their own files with ``--task-option``. With ``[partitioner]
name = "local"`` and ``[strategy] evaluate = "clients"`` the run trains and
evaluates only on the nodes, and each node's client count of examples is its
CSV's rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshkit.train import read_metrics

from tests.support.configs import external_config
from tests.support.nodes import run_with_nodes, spawn_node
pytestmark = pytest.mark.slow


def _write_csv(path: Path, rows: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
    table = np.column_stack([x[rows], y[rows]])
    np.savetxt(path, table, delimiter=",", fmt="%g")


SECRET = b"node-local-data-secret-0123456789"


def _nodes(node_flags: dict[int, list[str]], secret: Path) -> Any:
    """``start_nodes`` for :func:`run_with_nodes`: one node per rank, with its flags."""
    return lambda address: [spawn_node(rank, 3, address, secret, *flags)
                            for rank, flags in node_flags.items()]


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
    config = external_config(tmp_path, workers=2, rounds=2, secret=SECRET, extra=f"""
        evaluate = "clients"

        [partitioner]
        name = "local"

        [task]
        train_csv = "{tmp_path / 'nowhere' / 'train.csv'}"
        test_csv = "{tmp_path / 'nowhere' / 'test.csv'}"
    """)
    run_with_nodes(config, _nodes({
        rank: ["--task-option", f"train_csv={train}", "--task-option", f"test_csv={test}"]
        for rank, (train, test) in files.items()}, tmp_path / "secret"), timeout=120)
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
    config = external_config(tmp_path, workers=2, rounds=1, secret=SECRET, extra="""
        clients = 4

        [partitioner]
        name = "iid"
    """)
    run_with_nodes(config, _nodes({
        1: [], 2: ["--pull-data", "--task-option", f"train_csv={tmp_path / 'none.csv'}"]},
        tmp_path / "secret"), timeout=120)
    (line,) = read_metrics(tmp_path / "out")
    # A worker always serves the first client planned for it (only later ones
    # may move to a faster worker), so rank 2 trained on what it was sent.
    assert 2 in line["served"].values()
    assert sum(line["client_examples"].values()) == 1438  # every training row, once
