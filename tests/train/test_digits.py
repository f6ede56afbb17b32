"""The built-in ``digits`` task: shipped data, deterministic model, FedProx option."""

from __future__ import annotations

import importlib.resources

import numpy as np
import pytest

import meshkit.plugins
from meshkit.errors import ConfigError
from meshkit.task import create_task


@pytest.fixture(scope="module")
def task():
    return meshkit.plugins.create("task", "digits", {})


def test_the_shipped_dataset_is_the_1797_digits_with_its_provenance_stated():
    from meshkit_tasks.digits import load_digits

    x, y = load_digits()
    assert x.shape == (1797, 64) and y.shape == (1797,)
    assert x.min() == 0 and x.max() == 16
    assert sorted(set(y.tolist())) == list(range(10))
    data = importlib.resources.files("meshkit_tasks") / "data"
    readme = (data / "README.md").read_text()
    assert "UCI" in readme and "CC BY 4.0" in readme and "BSD 3-Clause" in readme
    assert (data / "digits.csv.gz").stat().st_size < 100_000


def test_train_and_held_out_splits_are_disjoint_and_cover_everything(task):
    (xtr, ytr), (xte, yte) = task.train_data(), task.test_data()
    assert len(ytr) + len(yte) == 1797 and len(yte) == 359
    rows = {r.tobytes() for r in xtr}
    # Held-out rows are not training rows (the digits set has few exact duplicates).
    assert sum(r.tobytes() in rows for r in xte) < 5


def test_the_initial_model_is_a_pure_function_of_the_seed(task):
    a, b, c = task.init_state(3), task.init_state(3), task.init_state(4)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["hidden.w"], c["hidden.w"])


def test_fit_is_deterministic_and_learns(task):
    x, y = task.train_data()
    start = task.init_state(0)
    first = task.fit(start, x, y, seed=1)
    again = task.fit(start, x, y, seed=1)
    assert all(np.array_equal(first.state[k], again.state[k]) for k in first.state)
    assert first.examples == len(y)
    assert task.evaluate(first.state)["accuracy"] > task.evaluate(start)["accuracy"] + 0.3
    # fit never mutates the state it was given (it is the round's global model).
    assert np.array_equal(start["hidden.w"], task.init_state(0)["hidden.w"])


def test_the_proximal_term_keeps_a_client_closer_to_the_global_model():
    x, y = meshkit.plugins.create("task", "digits", {}).train_data()
    plain = meshkit.plugins.create("task", "digits", {"epochs": 3})
    prox = meshkit.plugins.create("task", "digits", {"epochs": 3, "proximal_mu": 1.0})
    start = plain.init_state(0)

    def drift(result):
        return sum(float(np.sum((result.state[k] - start[k]) ** 2)) for k in start)

    assert drift(prox.fit(start, x[:200], y[:200], seed=0)) < 0.8 * drift(
        plain.fit(start, x[:200], y[:200], seed=0))


def test_gradients_then_apply_is_one_sgd_step(task):
    x, y = task.train_data()
    state = task.init_state(0)
    grads = task.gradients(state, x[:64], y[:64])
    stepped = task.apply(state, grads.state)
    lr = task.options.lr
    assert np.allclose(stepped["output.b"], state["output.b"] - lr * grads.state["output.b"])
    assert grads.examples == 64


def test_the_stages_compose_to_the_model(task):
    state = task.init_state(0)
    x, _ = task.test_data()
    out = x[:5]
    for node in task.stages():
        out = task.run_stage(state, node, out)
    assert np.allclose(np.exp(out) / np.exp(out).sum(1, keepdims=True), task.predict(state, x[:5]))
    with pytest.raises(KeyError, match="its stages are scale, hidden, output"):
        task.run_stage(state, "conv", x[:1])


def test_bad_task_options_are_config_errors_naming_the_key():
    with pytest.raises(ConfigError, match="proximal_mu"):
        meshkit.plugins.create("task", "digits", {"proximal_mu": -1.0})
    with pytest.raises(ConfigError, match="unknown key"):
        meshkit.plugins.create("task", "digits", {"hiden": 3})


@pytest.mark.parametrize("fraction, empty", [(0.0002, "test"), (0.9998, "training")])
def test_a_digits_split_that_leaves_a_side_empty_is_refused(fraction, empty):
    with pytest.raises(ConfigError, match=f"leaving an empty {empty} set"):
        create_task("digits", {"test_fraction": fraction})
