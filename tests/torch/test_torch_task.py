"""meshkit.torch.task: the task contract, fedavg over unequal shards, DDP-style replicas."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="meshkit.torch needs PyTorch (the torch extra)")

import meshkit  # noqa: E402
import meshkit.torch as mt  # noqa: E402
from meshkit.checkpoint import Checkpoint, save_checkpoint  # noqa: E402
from meshkit.task import FitResult, create_task  # noqa: E402
from meshkit.testing import TaskContract  # noqa: E402
from meshkit.testing.support import assert_states_identical  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # the example task is "examples.torch.digits_cnn:task"
    sys.path.insert(0, str(REPO))

EXAMPLE = "examples.torch.digits_cnn:task"
OPTIONS = {"threads": 1, "device": "cpu", "lr": 0.05}


class TestTheTorchExample(TaskContract):
    component = EXAMPLE
    options = OPTIONS


def _task(**overrides):
    return create_task(EXAMPLE, {**OPTIONS, **overrides})


def test_fedavg_over_unequal_shards_keeps_batchnorm_and_counts_batches(tmp_path):
    task = _task()
    model = task.init_state(0)
    x, y = task.train_data()
    big = task.fit(model, x[:96], y[:96], seed=1)     # 3 batches
    small = task.fit(model, x[96:160], y[96:160], seed=2)  # 2 batches
    fedavg = meshkit.plugins.create("aggregator", "fedavg")
    mean = fedavg.aggregate([big.state, small.state], [big.examples, small.examples])
    # (3 batches * 96 examples + 2 * 64) / 160 examples
    assert float(mean["features.1.num_batches_tracked"]) == pytest.approx(2.6)
    save_checkpoint(tmp_path, Checkpoint(round=1, state=mean))
    net = mt.load(tmp_path, task.build_model())
    assert int(net.features[1].num_batches_tracked) == 3
    expected = (96 * big.state["features.1.running_mean"]
                + 64 * small.state["features.1.running_mean"]) / 160
    np.testing.assert_allclose(net.features[1].running_mean.numpy(), expected, rtol=1e-5)


def test_data_parallel_replicas_keep_their_optimizer_and_stay_bit_identical():
    replicas = [_task(), _task()]
    allreduce = meshkit.plugins.create("aggregator", "allreduce")
    model = replicas[0].init_state(0)
    states = [model, dict(model)]
    x, y = replicas[0].train_data()
    for step in range(3):
        grads = [r.gradients(s, x[i * 64 + step * 16:][:16], None).state
                 for i, (r, s) in enumerate(zip(replicas, states))]
        assert not np.array_equal(grads[0]["features.1.running_mean"],
                                  grads[1]["features.1.running_mean"])
        mean = allreduce.aggregate(grads)
        states = [dict(r.apply(s, mean)) for r, s in zip(replicas, states)]
        assert_states_identical(states[1], states[0], what=f"replica 2 after step {step + 1}")
    # The momentum buffers are the replicas' own, carried from step to step.
    for r in replicas:
        assert r._replica.steps == 3 and r._replica.optimizer.state
    np.testing.assert_array_equal(states[0]["features.1.running_mean"],
                                  replicas[1]._replica.module.features[1].running_mean.numpy())


def test_a_state_a_replica_did_not_hand_out_restarts_its_optimizer():
    task = _task()
    model = task.init_state(0)
    x, _ = task.train_data()
    stepped = task.apply(model, task.gradients(model, x[:16], None).state)
    assert task._replica.optimizer.state
    task.gradients(task.init_state(1), x[:16], None)  # a resume, say
    assert task._replica.steps == 0 and not task._replica.optimizer.state
    assert stepped is not None


def test_fit_is_deterministic_and_leaves_earlier_results_alone():
    task = _task()
    model = task.init_state(0)
    x, y = task.train_data()
    first = task.fit(model, x[:64], y[:64], seed=3)
    kept = {k: np.array(v) for k, v in first.state.items() if isinstance(v, np.ndarray)}
    second = task.fit(model, x[64:128], y[64:128], seed=4)
    for key, value in kept.items():  # the second fit did not write into the first's arrays
        np.testing.assert_array_equal(first.state[key], value)
    assert not np.array_equal(first.state["head.weight"], second.state["head.weight"])


class RawIntegers(mt.TorchTask):
    """What the new user of issue 15 wrote: int64 num_batches_tracked, loaded non-strictly."""

    def fit(self, state, x, y, *, seed):
        result = super().fit(state, x, y, seed=seed)
        out = dict(result.state)
        for key, kind in out.pop(mt.INT_BUFFERS).items():
            out[key] = np.asarray(np.rint(out[key]), dtype=kind)
        return FitResult(out, result.examples, result.metrics)


class NonStrict(mt.TorchTask):
    def fit(self, state, x, y, *, seed):
        module = self.build_model()
        module.load_state_dict(mt.tensors_from_state(state), strict=False)
        return FitResult(dict(state), len(x), {"train_loss": 1.0})


def _contract_for(cls):
    example = _task()

    class Contract(TaskContract):
        def make(self, **overrides):
            return cls(model=example._model_factory, loss=example._loss,
                       data=example._data_factory, optimizer=example._optimizer_factory,
                       options=example.options)

    return Contract()


def test_the_contract_catches_integer_buffers_that_differ_across_shards():
    with pytest.raises(AssertionError, match="fedavg refuses integer arrays that differ"):
        _contract_for(RawIntegers).test_integer_arrays_agree_across_unequal_shards()


def test_the_contract_catches_a_non_strict_load():
    with pytest.raises(pytest.fail.Exception, match="strict=False"):
        _contract_for(NonStrict).test_fit_refuses_a_state_that_lacks_a_key()


def test_clients_evaluate_their_share_and_a_node_reads_its_own_data(tmp_path):
    from meshkit_tasks.digits import load_digits
    from meshkit.train import Trainer

    task = _task()
    state = task.init_state(0)
    rows, labels = task.test_data()
    whole = task.evaluate(state)
    halves = [task.evaluate(state, rows[:100], labels[:100]),
              task.evaluate(state, rows[100:], labels[100:])]
    mean = (100 * halves[0]["accuracy"] + (len(rows) - 100) * halves[1]["accuracy"]) / len(rows)
    assert mean == pytest.approx(whole["accuracy"])
    # The same through the worker's evaluate request (one client of three, iid).
    trainer = Trainer(task, partitioner=meshkit.plugins.create("partitioner", "iid"))
    reply = trainer.handle({"op": "evaluate", "state": state, "shard": 0, "shards": 3})
    assert reply["examples"] == len(np.array_split(rows, 3)[0])
    # A node's own files, through the example's `data` option: nothing read until needed.
    x, y = load_digits()
    for name, part in (("train", slice(0, 50)), ("test", slice(50, 70))):
        np.savetxt(tmp_path / f"{name}.csv", np.column_stack([x[part], y[part]]),
                   delimiter=",", fmt="%g")
    own = _task(data=str(tmp_path))
    assert len(own.train_data()[0]) == 50 and len(own.test_data()[0]) == 20
    assert "accuracy" in own.evaluate(own.init_state(0))


def test_a_spent_time_budget_stops_a_torch_fit_at_the_first_batch_and_reports_it():
    task = _task()
    model = task.init_state(0)
    x, y = task.train_data()
    batch = task.options.batch_size
    spent = task.fit(model, x[:3 * batch], y[:3 * batch], seed=1, time_budget=0.0)
    assert spent.examples == batch  # always one batch, then the spent budget stops it
    whole = task.fit(model, x[:3 * batch], y[:3 * batch], seed=1, time_budget=3600.0)
    assert whole.examples == 3 * batch * task.options.epochs
    assert_states_identical(whole.state, task.fit(model, x[:3 * batch], y[:3 * batch],
                                                  seed=1).state, what="an unspent budget")


def test_the_task_marks_its_modules_buffers_and_groups_its_normalisation_layers():
    task = _task()
    bn = [f"features.{i}.{k}" for i in (1, 5)
          for k in ("running_mean", "running_var", "num_batches_tracked")]
    assert task.buffers() == frozenset(bn)
    norm = task.key_groups()["norm"]
    assert norm == frozenset(bn) | {f"features.{i}.{k}" for i in (1, 5)
                                    for k in ("weight", "bias")}
    assert not any(k.startswith(("head.", "features.0.")) for k in norm)
    state = task.init_state(0)
    assert norm <= set(state)
