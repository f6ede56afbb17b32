"""meshkit.flower: Flower's quickstart-style clients, unchanged, under meshkit and under Flower.

The comparison drives the same client through Flower's own server loop
(``flwr.server.Server`` + ``FedAvg``, in-process client proxies:
examples/flower/flower_server.py) because Flower's simulation needs Ray;
same partitions, run config, rounds and seeds.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr", reason="meshkit.flower needs Flower (the flower extra)")

import meshkit  # noqa: E402
from meshkit import ConfigError, RefusedError  # noqa: E402
from meshkit.checkpoint import load_checkpoint  # noqa: E402
from meshkit.flower import AppOptions, FlowerOptions, FlowerTask, task, to_parameters  # noqa: E402
from meshkit.train import read_metrics  # noqa: E402

from tests.support.cli import run_cli  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # examples.flower, as the configs name it

from examples.flower import quickstart_numpy  # noqa: E402
from examples.flower.flower_server import run_flower  # noqa: E402

RUN_CONFIG = {"local-epochs": 5, "learning-rate": 0.5}


def _task(partitions: int = 4) -> FlowerTask:
    return FlowerTask(quickstart_numpy.client_fn,
                      FlowerOptions(num_partitions=partitions, run_config=RUN_CONFIG))


def test_parameters_map_to_state_keys_in_order():
    state = _task().init_state(seed=0)
    assert list(state) == ["p000", "p001"]
    expected = quickstart_numpy.initial_parameters()
    assert all(np.array_equal(a, b) for a, b in zip(to_parameters(state), expected))
    shuffled = {"p001": state["p001"], "p000": state["p000"]}
    assert [a.shape for a in to_parameters(shuffled)] == [(64, 10), (10,)]


def test_a_fit_is_the_partitions_own_with_its_num_examples():
    flower_task = _task()
    x, y = flower_task.train_data()
    result = flower_task.fit(flower_task.init_state(0), x[2:3], y[2:3], seed=1)
    (train_x, train_y), _ = quickstart_numpy.load_data(2, 4)
    assert result.examples == len(train_y)
    assert set(result.state) == {"p000", "p001"} and "train_loss" in result.metrics
    assert flower_task.context(2).node_config == {"partition-id": 2, "num-partitions": 4}
    assert flower_task.context(2).run_config == RUN_CONFIG


def test_evaluation_is_weighted_by_num_examples_over_the_partitions():
    flower_task = _task()
    state = flower_task.init_state(0)
    figures = [flower_task.evaluate(state, np.array([[p]]), None) for p in range(4)]
    sizes = [len(quickstart_numpy.load_data(p, 4)[1][1]) for p in range(4)]
    whole = flower_task.evaluate(state)
    assert whole["accuracy"] == pytest.approx(
        sum(n * f["accuracy"] for n, f in zip(sizes, figures)) / sum(sizes))


def test_a_client_holding_two_partitions_is_refused_saying_how_to_fix_it():
    flower_task = _task()
    x, y = flower_task.train_data()
    with pytest.raises(ConfigError, match=r"holds 2 Flower partitions.*partition-id c of 4"):
        flower_task.fit(flower_task.init_state(0), x[:2], y[:2], seed=0)


def test_a_time_budget_is_refused_saying_what_still_works():
    flower_task = _task()
    x, y = flower_task.train_data()
    with pytest.raises(RefusedError, match="round_timeout"):
        flower_task.fit(flower_task.init_state(0), x[:1], y[:1], seed=0, time_budget=1.0)


def test_a_client_asked_to_evaluate_every_partition_is_refused():
    flower_task = _task()
    x, y = flower_task.test_data()
    with pytest.raises(ConfigError, match=r"evaluates its own partition"):
        flower_task.evaluate(flower_task.init_state(0), x, y)


def test_task_wraps_a_client_fn_as_a_component():
    component = task(quickstart_numpy.client_fn)
    assert isinstance(component, meshkit.Component) and component.options is FlowerOptions
    built = component.build(FlowerOptions(num_partitions=2, run_config=RUN_CONFIG))
    assert len(built.train_data()[0]) == 2


@pytest.mark.parametrize("what, message", [
    ("strategy", "Flower FedAvg.*Strategy runs on Flower's server.*select \\[strategy\\]"),
    ("server_app", "ServerApp is Flower's server side"),
    ("mods", "ClientApp with mods.*a layer meshkit does not have"),
])
def test_what_cannot_map_is_refused_with_what_to_use_instead(what, message):
    from flwr.client import ClientApp
    from flwr.client.mod import fixedclipping_mod
    from flwr.server import ServerApp
    from flwr.server.strategy import FedAvg

    obj = {"strategy": FedAvg(), "server_app": ServerApp(),
           "mods": ClientApp(client_fn=quickstart_numpy.client_fn, mods=[fixedclipping_mod])}
    with pytest.raises(RefusedError, match=message):
        task(obj[what])


def test_a_client_app_runs_its_client_fn_through_the_app():
    options = FlowerOptions(num_partitions=4, run_config=RUN_CONFIG)
    direct = task(quickstart_numpy.client_fn).build(options)
    through_app = task(quickstart_numpy.app).build(options)
    state = direct.init_state(0)
    assert all(np.array_equal(a, b) for a, b in zip(
        to_parameters(state), to_parameters(through_app.init_state(0))))
    x, y = direct.train_data()
    ours, theirs = (t.fit(state, x[1:2], y[1:2], seed=5) for t in (direct, through_app))
    assert ours.examples == theirs.examples
    assert all(np.array_equal(a, b) for a, b in zip(to_parameters(ours.state),
                                                     to_parameters(theirs.state)))
    assert direct.evaluate(ours.state) == through_app.evaluate(theirs.state)


def test_the_registered_task_names_its_client_fn_in_the_config():
    from meshkit.flower import app_task

    built = app_task(AppOptions(app="examples.flower.quickstart_numpy:client_fn",
                                num_partitions=3, run_config=RUN_CONFIG))
    assert built.client_fn is quickstart_numpy.client_fn
    from_app = app_task(AppOptions(app="examples.flower.quickstart_numpy:app",
                                   num_partitions=3, run_config=RUN_CONFIG))
    assert from_app.client_fn.app is quickstart_numpy.app


def _config(tmp_path: Path, module: str, rounds: int, workers: int = 2,
            attribute: str = "client_fn") -> Path:
    path = tmp_path / "flower.toml"
    path.write_text(textwrap.dedent(f"""
        [run]
        task = "flower"
        seed = 0
        out = "{tmp_path / 'run'}"

        [mesh]
        launch = "local"
        workers = {workers}

        [strategy]
        name = "federated"
        rounds = {rounds}
        clients = 4

        [task]
        app = "examples.flower.{module}:{attribute}"
        num_partitions = 4

        [task.run_config]
        local-epochs = 5
        learning-rate = 0.5
    """))
    return path


def _same_as_flower(tmp_path: Path, module: str, rounds: int, *, in_process: bool = False,
                    attribute: str = "client_fn",
                    monkeypatch: pytest.MonkeyPatch | None = None) -> None:
    if in_process:  # the coordinator here (torch already imported), one worker process
        assert monkeypatch is not None
        monkeypatch.setenv("PYTHONPATH", str(REPO))
        # One OpenMP thread per worker, as Ray gives Flower's simulated clients:
        # two-thread workers on two shared cores spin against each other.
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        monkeypatch.chdir(tmp_path)
        meshkit.run(str(_config(tmp_path, module, rounds, workers=1, attribute=attribute)))
    else:  # the real CLI, as a user runs it
        config = _config(tmp_path, module, rounds, attribute=attribute)
        ran = run_cli("run", str(config), "-q", cwd=str(tmp_path), pythonpath=str(REPO),
                      timeout=300)
        assert ran.returncode == 0, ran.stderr
    meshkit_last = read_metrics(tmp_path / "run")[-1]
    client_fn = getattr(__import__(f"examples.flower.{module}", fromlist=["client_fn"]),
                        "client_fn")
    flower = run_flower(client_fn, num_partitions=4, rounds=rounds, run_config=RUN_CONFIG)
    assert meshkit_last["round"] == rounds
    assert meshkit_last["accuracy"] == flower["accuracy"]
    final = to_parameters(load_checkpoint(tmp_path / "run").state)
    # Each figure at the precision the model carries: the loss is computed
    # from the model, so a float32 model's loss agrees to float32's precision.
    rtol = _rtol(final[0].dtype)
    assert meshkit_last["loss"] == pytest.approx(flower["loss"], rel=rtol)
    for ours, theirs in zip(final, flower["parameters"], strict=True):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        # Flower's FedAvg sums float32 models in float32, meshkit's in float64
        # (then rounds to float32): the two agree to float32 rounding.
        np.testing.assert_allclose(ours, theirs, rtol=_rtol(theirs.dtype),
                                   atol=_rtol(theirs.dtype) * 1e-2)


def _rtol(dtype: np.dtype) -> float:
    """A relative tolerance at ``dtype``'s precision: float64 1e-9 (the numpy
    quickstart's model), float32 1e-6 (about 8 of its 1.2e-7 epsilons) — never a
    float64 tolerance on a float32 figure."""
    return 1e-9 if np.dtype(dtype) == np.float64 else 1e-6


@pytest.mark.slow
def test_the_numpy_quickstart_app_matches_flowers_fedavg(tmp_path):
    # [task] app names the ClientApp, as pyproject.toml's clientapp does.
    _same_as_flower(tmp_path, "quickstart_numpy", rounds=4, attribute="app")


@pytest.mark.slow
def test_the_torch_quickstart_matches_flowers_fedavg(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    _same_as_flower(tmp_path, "quickstart_torch", rounds=2, in_process=True,
                    monkeypatch=monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [4, 2], ids=["flat", "batched"])
def test_a_deterministically_broken_client_fails_alone_and_every_worker_serves_on(tmp_path,
                                                                                  workers):
    # Before issue 34 the wrong shape cost each worker that served client 2 its rank,
    # in turn, until none was left ("0 of 4 clients served").
    config = _config(tmp_path, "quickstart_numpy", rounds=2, workers=workers)
    config.write_text(config.read_text().replace(
        'app = "examples.flower.quickstart_numpy:client_fn"',
        'app = "tests.support.flower_bad_client:client_fn"'))
    ran = run_cli("run", str(config), "-q", cwd=str(tmp_path), pythonpath=str(REPO),
                  timeout=300)
    assert ran.returncode == 0, ran.stderr
    rows = read_metrics(tmp_path / "run")
    assert [row["round"] for row in rows] == [1, 2]
    for row in rows:
        assert list(row["not_served"]) == ["2"], row
        assert row["not_served"]["2"].startswith("failed on 2 ranks, so the failure is its own")
        assert "'p000' is an array float64[65, 10] where the model has an array " \
               "float64[64, 10]" in row["not_served"]["2"], row["not_served"]
        assert sorted(map(int, row["served"])) == [0, 1, 3]
        assert row["dropped"] == [] and row["failed"] == {}


@pytest.mark.slow
def test_a_client_whose_fit_hangs_costs_two_workers_once_and_is_not_tried_again(tmp_path):
    # Issue 34: a Flower client that hangs was served again on each next worker after
    # the first was dropped, until none was left. Now the second stall makes the hang
    # the client's own: it is recorded failed, and not tried again in the run.
    config = _config(tmp_path, "quickstart_numpy", rounds=3, workers=4)
    config.write_text(config.read_text().replace(
        'app = "examples.flower.quickstart_numpy:client_fn"',
        'app = "tests.support.flower_bad_client:hanging_client_fn"').replace(
        "workers = 4", "workers = 4\ntimeout = 3"))
    ran = run_cli("run", str(config), "-q", cwd=str(tmp_path), pythonpath=str(REPO),
                  timeout=300)
    assert ran.returncode == 0, ran.stderr
    rows = read_metrics(tmp_path / "run")
    assert [row["round"] for row in rows] == [1, 2, 3]
    # Round 1: two workers stalled on client 2 (and are lost); the two left serve the rest.
    assert len(rows[0]["dropped"]) == 2, rows[0]
    for row in rows:
        assert list(row["not_served"]) == ["2"], row
        assert sorted(map(int, row["served"])) == [0, 1, 3], row
    assert rows[0]["not_served"]["2"].startswith("failed on 2 ranks, so the failure is its own")
    # Rounds 2 and 3: not tried again, so no other worker is lost to it.
    for row in rows[1:]:
        assert row["dropped"] == [], row
        assert row["not_served"]["2"].startswith("quarantined: failed on 2 ranks"), row
        assert set(row["served"].values()) <= set(range(1, 5)) - set(rows[0]["dropped"])
