"""meshkit.flower: a Message-API ClientApp (``@app.train()``, ``@app.evaluate()``) as a task.

The fast tests drive a small numpy app written here, whose replies say what
it received; the slow ones run ``examples/flower-message`` (quickstart-
pytorch's shape) with the real ``meshkit run`` and the same app under
Flower's own Message-API ``FedAvg`` (examples/flower/flower_grid.py).
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr", reason="meshkit.flower needs Flower (the flower extra)")

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

from meshkit import ConfigError, MeshError, RefusedError  # noqa: E402
from meshkit.checkpoint import load_checkpoint  # noqa: E402
from meshkit.config import parse_config  # noqa: E402
from meshkit.train._coordinator.plan import resolve
from meshkit.flower import FlowerOptions, task  # noqa: E402
from meshkit.train import Trainer, read_metrics  # noqa: E402

from tests.support.cli import run_cli  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "flower-message"


def _initial() -> list[np.ndarray]:
    return [np.zeros((2, 3), dtype=np.float32), np.arange(3, dtype=np.float32)]


def _recording_app(weight_key: str = "num-examples") -> ClientApp:
    """A Message-API app whose train adds config["lr"] and whose replies say what it got."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        arrays = msg.content["arrays"]
        stepped = ArrayRecord({k: type(a)(a.numpy() + msg.content["config"]["lr"])
                               for k, a in arrays.items()})
        partition = context.node_config["partition-id"]
        metrics = MetricRecord({weight_key: 10 + partition, "partition": partition,
                                "of": context.node_config["num-partitions"],
                                "epochs": context.run_config["local-epochs"]})
        return Message(content=RecordDict({"arrays": stepped, "metrics": metrics}),
                       reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        partition = context.node_config["partition-id"]
        total = float(sum(a.numpy().sum() for a in msg.content["arrays"].values()))
        metrics = MetricRecord({"eval_acc": float(partition), "total": total,
                                "num-examples": 10 + partition})
        return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)

    return app


def _options(**overrides) -> FlowerOptions:
    return FlowerOptions(**{"num_partitions": 3, "run_config": {"local-epochs": 2},
                            "train_config": {"lr": 0.5}, **overrides})


def test_a_train_message_carries_the_model_and_config_and_its_reply_is_the_contribution():
    built = task(_recording_app(), initial=_initial).build(_options())
    state = built.init_state(0)
    assert list(state) == ["0", "1"]  # Flower's own keys for a list of arrays
    x, y = built.client_data(2)
    result = built.fit(state, x, y, seed=7)
    np.testing.assert_array_equal(result.state["1"], np.arange(3, dtype=np.float32) + 0.5)
    assert result.state["0"].dtype == np.float32
    assert result.examples == 12  # the reply's "num-examples": fedavg's weight
    assert result.metrics == {"partition": 2.0, "of": 3.0, "epochs": 2.0}


def test_an_evaluation_is_flowers_weighted_average_of_the_metric_records():
    built = task(_recording_app(), initial=_initial).build(_options())
    state = built.init_state(0)
    figures = built.evaluate(state)
    sizes = [10, 11, 12]
    assert figures["eval_acc"] == pytest.approx(sum(n * p for n, p in zip(sizes, range(3)))
                                                / sum(sizes), rel=1e-12)
    assert figures["total"] == pytest.approx(3.0)  # the arrays it was sent: 0+1+2
    assert "num-examples" not in figures


def test_a_client_evaluation_is_weighed_by_its_num_examples_not_its_one_row():
    built = task(_recording_app(), initial=_initial).build(_options())
    trainer = Trainer(built)
    reply = trainer.handle({"op": "evaluate", "state": built.init_state(0), "shard": 1,
                            "shards": 3})
    assert reply["examples"] == 11
    assert reply["metrics"]["eval_acc"] == 1.0 and "examples" not in reply["metrics"]


def test_a_message_api_app_without_initial_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"\[task\] initial: a Message-API ClientApp.*"
                                          r"initial = \"pkg.task:Net\""):
        task(_recording_app()).build(_options())


def test_a_reply_without_the_weight_names_the_key_and_the_option():
    built = task(_recording_app(weight_key="n"), initial=_initial).build(_options())
    x, y = built.client_data(0)
    with pytest.raises(MeshError, match=r"no 'num-examples'.*\[task\] weighted_by_key"):
        built.fit(built.init_state(0), x, y, seed=0)
    fine = task(_recording_app(weight_key="n"), initial=_initial).build(
        _options(weighted_by_key="n"))
    assert fine.fit(fine.init_state(0), x, y, seed=0).examples == 10


def test_a_message_api_app_with_mods_is_refused():
    from flwr.clientapp.mod import fixedclipping_mod

    app = ClientApp(mods=[fixedclipping_mod])

    @app.train()
    def train(msg, context):  # pragma: no cover - refused before any call
        return msg

    with pytest.raises(RefusedError, match="ClientApp with mods"):
        task(app, initial=_initial)

    per_function = ClientApp()

    @per_function.train(mods=[fixedclipping_mod])
    def train_with_mods(msg, context):  # pragma: no cover - refused before any call
        return msg

    with pytest.raises(RefusedError, match=r"registers train.default with mods.*Register the "
                                           r"functions without mods"):
        task(per_function, initial=_initial)


@pytest.mark.parametrize("form", ["module", "state_dict", "array_record", "numpy_state_dict"])
def test_initial_takes_what_a_server_app_passes_as_initial_arrays(form):
    torch = pytest.importorskip("torch")

    def initial():
        net = torch.nn.Linear(3, 2)
        return {"module": net, "state_dict": net.state_dict(),
                "array_record": ArrayRecord(net.state_dict()),
                "numpy_state_dict": {k: v.numpy() for k, v in net.state_dict().items()}}[form]

    state = task(_recording_app(), initial=initial).build(_options()).init_state(3)
    torch.manual_seed(3)
    expected = torch.nn.Linear(3, 2).state_dict()
    assert list(state) == ["weight", "bias"]
    for key, value in expected.items():
        np.testing.assert_array_equal(state[key], value.numpy())


def test_an_initial_that_is_no_model_is_refused_saying_what_it_should_return():
    built = task(_recording_app(), initial=lambda: "a model").build(_options())
    with pytest.raises(ConfigError, match="returned a str; it should return a torch nn.Module, "
                                          "a state_dict, a Flower ArrayRecord or a list"):
        built.init_state(0)


def test_num_partitions_follows_strategy_clients_and_reaches_the_workers():
    plan = resolve(parse_config({
        "run": {"task": "flower"}, "strategy": {"clients": 3},
        "task": {"app": "examples.flower.quickstart_numpy:client_fn"}}))
    assert plan.options["task"].num_partitions == 3
    assert plan.config.task.options["num_partitions"] == 3  # the table a worker is sent
    given = resolve(parse_config({
        "run": {"task": "flower"}, "strategy": {"clients": 3},
        "task": {"app": "examples.flower.quickstart_numpy:client_fn", "num_partitions": 5}}))
    assert given.options["task"].num_partitions == 5  # given: kept (check refuses it)


# -- what `meshkit check` says -------------------------------------------------

def _config(tmp_path: Path, *, strategy: str = "clients = 4", task_keys: str = "",
            aggregator: str = "fedavg", app: str = "examples.flower.quickstart_numpy:app") -> str:
    path = tmp_path / "flower.toml"
    path.write_text(textwrap.dedent(f"""
        [run]
        task = "flower"
        out = "{tmp_path / 'run'}"

        [strategy]
        name = "federated"
        rounds = 2
        {strategy}

        [aggregator]
        name = "{aggregator}"

        [task]
        app = "{app}"
        {task_keys}

        [task.run_config]
        local-epochs = 1
        learning-rate = 0.5
    """))
    return str(path)


def _check(config: str) -> object:
    return run_cli("check", config, pythonpath=str(REPO), cwd=str(REPO))


def _assert_refused(ran, *fragments: str) -> None:
    assert ran.returncode == 2, ran.stderr
    assert "Traceback" not in ran.stderr
    for fragment in fragments:
        assert fragment in ran.stderr, ran.stderr


def test_check_refuses_clients_that_are_not_the_partitions(tmp_path):
    ran = _check(_config(tmp_path, strategy="clients = 3", task_keys="num_partitions = 4"))
    _assert_refused(ran, "flower.toml", "[strategy] clients = 3, but the task is a population "
                                        "of 4 clients")


def test_check_refuses_a_run_that_says_neither_clients_nor_partitions(tmp_path):
    ran = _check(_config(tmp_path, strategy=""))
    _assert_refused(ran, "flower.toml", "[task] num_partitions: not given, and neither is "
                                        "[strategy] clients")


def test_check_says_fedadam_is_an_outer_optimizer(tmp_path):
    ran = _check(_config(tmp_path, aggregator="fedadam"))
    _assert_refused(ran, "flower.toml", "[aggregator] name: no aggregator named 'fedadam': "
                                        "'fedadam' is an outer_optimizer",
                    "select it as [outer_optimizer] name = \"fedadam\"")
    assert "did you mean" not in ran.stderr


def test_check_refuses_a_message_api_app_without_its_initial_model(tmp_path):
    app = "digitsexample.client_app:app"
    path = _config(tmp_path, app=app)
    ran = run_cli("check", path, pythonpath=str(EXAMPLE), cwd=str(EXAMPLE))
    _assert_refused(ran, "flower.toml", "[task] initial: a Message-API ClientApp")


def test_check_passes_the_message_api_example(tmp_path):
    ran = run_cli("check", "meshkit.toml", cwd=str(EXAMPLE), timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert "num_partitions=4" in ran.stdout and "clients: 4 (the task's population)" in ran.stdout


# -- the same app under meshkit and under Flower --------------------------------

@pytest.mark.slow
@pytest.mark.timeout(600)  # a hang guard: two whole federations, under load (CI) in minutes
def test_the_message_api_quickstart_matches_flowers_fedavg(tmp_path):
    torch = pytest.importorskip("torch")
    rounds = 2
    config = (EXAMPLE / "meshkit.toml").read_text().replace(
        'out = "runs/flower-message"', f'out = "{tmp_path / "run"}"').replace(
        "rounds = 5 ", f"rounds = {rounds} ")
    (tmp_path / "meshkit.toml").write_text(config)
    # One OpenMP thread per worker, as Ray gives Flower's simulated clients.
    ran = run_cli("run", str(tmp_path / "meshkit.toml"), "-q", cwd=str(EXAMPLE),
                  env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert ran.returncode == 0, ran.stderr

    sys.path.insert(0, str(EXAMPLE))
    # Flower's loop runs in this process: one intra-op thread too, as its workers had
    # (under load, two spinning OpenMP threads per process made it ten times slower).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        from digitsexample.client_app import app
        from digitsexample.task import Net

        from examples.flower.flower_grid import run_flower_app
        flower = run_flower_app(app, Net, num_partitions=4, rounds=rounds,
                                run_config={"local-epochs": 1, "batch-size": 32},
                                train_config={"lr": 0.1})
    finally:
        torch.set_num_threads(threads)
        sys.path.remove(str(EXAMPLE))
    ours = read_metrics(tmp_path / "run")[-1]
    assert ours["round"] == rounds
    # The same correct predictions; the average of the partitions' accuracies is
    # float64 arithmetic done in another order (Flower: sum of w/W * a).
    assert ours["eval_acc"] == pytest.approx(flower["evaluate"]["eval_acc"], rel=1e-12)
    # float32 models: each figure at float32's precision (rtol 1e-6).
    assert ours["eval_loss"] == pytest.approx(flower["evaluate"]["eval_loss"], rel=1e-6)
    assert ours["train_loss"] == pytest.approx(flower["train"]["train_loss"], rel=1e-6)
    final = load_checkpoint(tmp_path / "run").state
    assert sorted(final) == sorted(flower["arrays"])
    for key, theirs in flower["arrays"].items():
        assert final[key].dtype == theirs.dtype == np.float32
        np.testing.assert_allclose(final[key], theirs, rtol=1e-6, atol=1e-8)


@pytest.mark.slow
def test_clients_evaluate_their_own_partitions_with_no_partitioner(tmp_path):
    """evaluate = "clients" with no [partitioner] and no [strategy] clients: each client
    evaluates its own partition, weighted by its num_examples, as Flower's FedAvg."""
    from examples.flower.flower_server import run_flower
    from examples.flower.quickstart_numpy import client_fn

    path = _config(tmp_path, strategy='evaluate = "clients"', task_keys="num_partitions = 3")
    ran = run_cli("run", path, "-q", pythonpath=str(REPO), cwd=str(REPO), timeout=300)
    assert ran.returncode == 0, ran.stderr
    ours = read_metrics(tmp_path / "run")[-1]
    flower = run_flower(client_fn, num_partitions=3, rounds=2,
                        run_config={"local-epochs": 1, "learning-rate": 0.5})
    assert ours["clients"] == [0, 1, 2]
    assert ours["client_accuracy"] == pytest.approx(flower["accuracy"], rel=1e-9)  # float64
    assert ours["client_loss"] == pytest.approx(flower["loss"], rel=1e-9)
