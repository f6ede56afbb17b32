"""A node's own task options (``--task-option``) and held-out data, on the worker side."""

from __future__ import annotations

import numpy as np
import pytest

from meshkit import ConfigError
from meshkit.train import Trainer
from meshkit.train._worker.node_job import with_node_options
from meshkit.train._worker.trainer import _trainer

SPEC = {"task": "digits", "task_options": {"epochs": 2, "train_csv": "/nowhere.csv"},
        "seed": 0}


def test_task_options_override_the_coordinators_on_this_node_only():
    spec = with_node_options(SPEC, ["train_csv=/data/mine.csv", "epochs=3"])
    assert spec["task_options"] == {"epochs": 3, "train_csv": "/data/mine.csv"}
    assert SPEC["task_options"]["epochs"] == 2  # the job itself is not changed


def test_an_unknown_task_option_key_is_refused_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"--task-option.*tran_csv.*did you mean 'train_csv'"):
        with_node_options(SPEC, ["tran_csv=/data/mine.csv"])


def test_a_task_option_of_the_wrong_type_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"--task-option epochs: expected an integer"):
        with_node_options(SPEC, ["epochs=many"])


def test_building_the_task_reads_no_data():
    trainer = _trainer(SPEC)  # /nowhere.csv is only read when a method needs it
    with pytest.raises(ConfigError, match="train_csv = '/nowhere.csv': no such file"):
        trainer.train_data()


def test_a_node_without_held_out_data_says_so(tmp_path):
    from meshkit_tasks.digits import load_digits

    x, y = load_digits()
    path = tmp_path / "mine.csv"
    np.savetxt(path, np.column_stack([x[:40], y[:40]]), delimiter=",", fmt="%g")
    trainer = _trainer({"task": "digits", "task_options": {"train_csv": str(path)}})
    assert trainer.handle({"op": "held_out"})["examples"] == 0
    assert len(trainer.train_data()[1]) == 40


def test_clients_evaluate_their_share_of_the_held_out_set():
    spec = {"task": "digits", "seed": 3,
            "partitioner": {"name": "iid", "options": {}}}
    trainer = _trainer(spec)
    state = trainer.task.init_state(0)
    replies = [trainer.handle({"op": "evaluate", "state": state, "shard": c, "shards": 3})
               for c in range(3)]
    assert sum(r["examples"] for r in replies) == len(trainer.task.test_data()[1])
    assert all(0.0 <= r["metrics"]["accuracy"] <= 1.0 for r in replies)


def test_pulled_data_replaces_the_tasks_own():
    x = np.zeros((6, 64))
    y = np.arange(6) % 10
    trainer = _trainer({"task": "digits", "data": {"x": x, "y": y}})
    assert isinstance(trainer, Trainer)
    assert len(trainer.train_data()[1]) == 6


@pytest.mark.slow
def test_a_nodes_refusal_reaches_the_coordinators_message_without_resume_advice(tmp_path):
    """The node says why it leaves (report_job_error); the coordinator's error quotes it, and
    with no round done there is no checkpoint, so no --resume advice."""
    import threading

    from meshkit.train import Runner

    from tests.support.configs import external_config
    from tests.support.nodes import finish, spawn_node

    config = external_config(tmp_path, workers=1, rounds=1, secret=b"r" * 32)
    listening, errors = [], []
    ready = threading.Event()

    def progress(event):
        if event.kind == "listening":
            listening.append(event.message.split()[3])
            ready.set()

    def drive():
        try:
            Runner(str(config), progress=progress).run()
        except Exception as exc:  # the run's error, read below
            errors.append(exc)
        ready.set()

    coordinator = threading.Thread(target=drive, daemon=True)
    coordinator.start()
    assert ready.wait(60) and listening, errors
    node = spawn_node(1, 2, listening[0], tmp_path / "secret", "--task-option", "data=/x")
    _, err = finish(node, 120)
    coordinator.join(120)
    assert node.returncode == 2
    assert "--task-option data: unknown key; the keys are hidden, lr" in err
    (error,) = errors
    assert "it reported: rank 1: --task-option data: unknown key; the keys are" in str(error)
    assert "no checkpoint to resume from" in str(error) and "with --resume" not in str(error)
