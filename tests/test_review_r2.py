"""Review R2 (runs): regression tests for bugs found in checkpoints, strategies, config, tasks."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

import meshkit
import meshkit.plugins
from meshkit.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from meshkit.config import check, load_config, parse_config
from meshkit.errors import ConfigError, MeshError
from meshkit.train import Runner, build_components
from meshkit.state import BFLOAT16
from meshkit.train import StrategyContext, sample_clients
from meshkit.task import FitResult, create_task
from meshkit.train import LocalPool

# -- checkpoints ---------------------------------------------------------------


def _header(text: bytes) -> np.ndarray:
    return np.frombuffer(text, dtype=np.uint8)


def _write_truncated(path):
    save_checkpoint(path.parent, Checkpoint(round=1, state={"w": np.ones(64)}))
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])


CORRUPTIONS = {
    "truncated (torn copy)": _write_truncated,
    "empty file": lambda p: p.write_bytes(b""),
    "zip magic then garbage": lambda p: p.write_bytes(b"PK\x03\x04" + b"\x00" * 64),
    "a bare .npy array": lambda p: p.write_bytes(_npy_bytes()),
    "header not utf-8": lambda p: _savez(p, __meta__=_header(b"\xff\xfe")),
    "header not json": lambda p: _savez(p, __meta__=_header(b"not json")),
    "header a list": lambda p: _savez(p, __meta__=_header(b"[1, 2]")),
    "header missing round": lambda p: _savez(p, __meta__=_header(b'{"format": 1}')),
    "dangling array reference": lambda p: _savez(p, __meta__=_header(json.dumps({
        "format": 1, "round": 1, "state": {"w": {"__array__": "state/w"}}, "outer": {},
        "rng": {}, "identity": {}}).encode())),
}


def _savez(path, **arrays):
    with open(path, "wb") as fh:
        np.savez(fh, **arrays)


def _npy_bytes() -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, np.arange(3))
    return buf.getvalue()


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_corrupted_checkpoint_is_a_clear_config_error_not_a_traceback(tmp_path, corruption):
    path = tmp_path / "checkpoint.npz"
    CORRUPTIONS[corruption](path)
    with pytest.raises(ConfigError, match=r"checkpoint .*checkpoint\.npz"):
        load_checkpoint(tmp_path)


def test_a_bfloat16_state_survives_a_checkpoint_with_its_dtype(tmp_path):
    w = np.array([1.5, -2.25, 3.0], dtype=BFLOAT16)
    save_checkpoint(tmp_path, Checkpoint(round=2, state={"w": w, "b": np.zeros(2)},
                                         outer_state={"m": {"w": w.copy()}}))
    back = load_checkpoint(tmp_path)
    assert back.state["w"].dtype == BFLOAT16
    assert back.outer_state["m"]["w"].dtype == BFLOAT16
    assert np.array_equal(back.state["w"].astype(np.float32), w.astype(np.float32))
    assert back.state["b"].dtype == np.float64


def test_state_from_a_missing_file_names_state_from_not_resume(tmp_path):
    with pytest.raises(ConfigError) as err:
        meshkit.plugins.create("strategy", "model-parallel",
                               {"state_from": str(tmp_path / "nope.npz")})
    assert "state_from" in str(err.value) and "--resume" not in str(err.value)


# -- client sampling and strategies -------------------------------------------


def test_fraction_sampling_takes_the_documented_ceiling_despite_float_error():
    # 0.07 * 100 == 7.000000000000001 in binary floating point.
    assert len(sample_clients(np.random.default_rng(0), 100, 0.07, 1)) == 7
    assert len(sample_clients(np.random.default_rng(0), 25, 0.28, 1)) == 7
    assert len(sample_clients(np.random.default_rng(0), 10, 0.25, 1)) == 3


def test_a_tiny_fraction_still_samples_at_least_one_client():
    assert len(sample_clients(np.random.default_rng(0), 10, 1e-12, 0)) == 1


class Rows:
    """A task whose model is the mean of the shard it was fit on."""

    def __init__(self, rows: int = 8) -> None:
        self.x = np.arange(rows, dtype=np.float64).reshape(rows, 1)
        self.y = np.arange(rows, dtype=np.float64)

    def init_state(self, seed):
        return {"m": np.zeros(1)}

    def train_data(self):
        return self.x, self.y

    def fit(self, state, x, y, *, seed):
        return FitResult({"m": np.array([x.mean()])}, len(x), {})

    def evaluate(self, state):
        return {"m": float(np.asarray(state["m"])[0])}

    def gradients(self, state, x, y):
        return FitResult({"m": np.ones(1)}, len(x), {})

    def apply(self, state, gradients):
        return {"m": np.asarray(state["m"]) - np.asarray(gradients["m"])}


def make_ctx(task, ranks=(1, 2), outer=None, **kw):
    return StrategyContext(
        task=task, aggregator=meshkit.plugins.create("aggregator", "fedavg"),
        pool=LocalPool.of(lambda: task, ranks), workers=list(ranks),
        rng=np.random.default_rng(0),
        outer=outer or meshkit.plugins.create("outer_optimizer", "average"), **kw)


def test_min_clients_counts_answers_so_two_workers_can_serve_three_of_four_clients():
    ctx = make_ctx(Rows(8), ranks=(1, 2))
    strategy = meshkit.plugins.create("strategy", "federated",
                                      {"rounds": 1, "clients": 4, "min_clients": 3})
    result = strategy.run(ctx)
    assert float(result.state["m"][0]) == pytest.approx(3.5)


class PlusHundred:
    """An outer optimizer whose step is unmistakable."""

    def step(self, global_state, consensus):
        return {k: np.asarray(v) + 100.0 for k, v in consensus.items()}

    def state_dict(self):
        return {}

    def load_state_dict(self, d):
        pass


def test_the_local_strategy_steps_the_outer_optimizer_as_documented():
    ctx = make_ctx(Rows(8), ranks=(1,), outer=PlusHundred())
    result = meshkit.plugins.create("strategy", "local", {"rounds": 1}).run(ctx)
    assert float(result.state["m"][0]) == pytest.approx(3.5 + 100.0)


def test_more_federated_clients_than_training_rows_is_refused_before_the_run():
    strategy = meshkit.plugins.create("strategy", "federated", {"clients": 9})
    with pytest.raises(ConfigError, match="clients = 9 but the task has only 8 training rows"):
        strategy.check(task=Rows(8), outer_name="average", workers=2)


def test_more_data_parallel_workers_than_training_rows_is_refused_before_the_run():
    strategy = meshkit.plugins.create("strategy", "data-parallel", {})
    with pytest.raises(ConfigError, match="3 training rows over 4 workers"):
        strategy.check(task=Rows(3), outer_name="average", workers=4)


# -- config ----------------------------------------------------------------------


def write(tmp_path, text: str, name: str = "c.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def user_tasks(tmp_path, monkeypatch):
    (tmp_path / "r2_tasks_boom.py").write_text(textwrap.dedent("""
        class Boom:
            def __init__(self):
                raise RuntimeError("no GPU here")

        class DictOptions:
            Options = dict

        flag = False
    """))
    (tmp_path / "r2_tasks_raises.py").write_text('raise RuntimeError("import-time failure")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("task, message", [
    ("r2_tasks_boom:Boom", "building it raised RuntimeError: no GPU here"),
    ("r2_tasks_raises:Task", "importing it raised RuntimeError: import-time failure"),
    (":Task", "expected a registered task name or 'module:attribute'"),
    ("r2_tasks_boom:flag", "is a bool, not a task factory"),
    ("r2_tasks_boom:DictOptions", r"is missing init_state\(\)"),
])
def test_a_module_task_that_raises_or_is_wrong_is_a_config_error_naming_the_file(
        user_tasks, task, message):
    path = write(user_tasks, f"""
        [run]
        task = "{task}"
        out = "{user_tasks / 'out'}"
    """)
    with pytest.raises(ConfigError, match=message) as err:
        build_components(check(path))
    assert str(err.value).startswith(f"{path}: [run] task")


def test_a_worker_building_a_raising_task_gets_a_config_error(user_tasks):
    with pytest.raises(ConfigError, match="building it raised RuntimeError: no GPU here"):
        create_task("r2_tasks_boom:Boom")


def test_a_negative_seed_is_refused_at_load_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"\[run\].*seed.*>= 0"):
        load_config(write(tmp_path, "[run]\nseed = -1\n"))


@pytest.mark.parametrize("value", ["inf", "9.3e9"])
@pytest.mark.parametrize("key", ["timeout", "join_timeout"])
def test_an_infinite_or_overflowing_timeout_is_refused_at_load(tmp_path, key, value):
    with pytest.raises(ConfigError, match=f"{key} must be a finite number of seconds, "
                                          f"at most 1e\\+09"):
        load_config(write(tmp_path, f"[mesh]\n{key} = {value}\n"))


MP = """
[strategy]
name = "model-parallel"
[[strategy.partitions]]
"""


@pytest.mark.parametrize("partition, message", [
    ('nodes = ["scale", "hidden", "output"]\nrank = 1.9',
     "[strategy] partitions[0].rank: expected an integer, got 1.9"),
    ('nodes = ["scale", "hidden", "output"]\nrank = true',
     "[strategy] partitions[0].rank: expected an integer, got True"),
    ('nodes = "scale"\nrank = 1',
     "[strategy] partitions[0].nodes: expected an array, got 'scale'"),
    ('nodes = ["scale", "hidden", "output"]\ntag = 5',
     "[strategy] partitions[0].tag: expected a string, got 5"),
    ('nodes = ["scale", "hidden", "output"]\nrank = 1\n[[strategy.boards]]\noptions = 5',
     "[strategy] boards[0].options: expected a table, got 5"),
])
def test_wrong_types_in_nested_tables_are_refused_not_coerced(tmp_path, partition, message):
    path = write(tmp_path, MP + partition + "\n")
    with pytest.raises(ConfigError) as err:
        check(path)
    assert str(err.value) == f"{path}: {message}"


def test_an_unknown_key_in_a_nested_table_reads_as_table_then_key(tmp_path):
    path = write(tmp_path, MP + 'nodes = ["scale", "hidden", "output"]\nrank = 1\n'
                 '[[strategy.boards]]\noptions = {stage_id = "scale"}\nbord = "x"\n')
    with pytest.raises(ConfigError, match=r"\[strategy\] boards\[0\]\.bord: unknown key"):
        check(path)


def test_the_coordinator_strips_meshkit_secret_like_meshkit_node_does():
    from meshkit.cli import read_secret

    env = {"MESHKIT_SECRET": "s" * 32 + "\n"}
    config = parse_config({})
    assert config.secret(env) == read_secret(None, env) == b"s" * 32


# -- the runner ---------------------------------------------------------------------


def test_a_run_that_dies_of_a_non_mesh_error_is_not_reported_ok(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHKIT_SECRET", "x" * 32)
    out = tmp_path / "out"
    path = write(tmp_path, f"""
        [run]
        out = "{out}"
        [mesh]
        launch = "external"
        bind = "127.0.0.1:0"
        workers = 1
    """)
    finished = []

    class Watch:
        @meshkit.hookimpl
        def meshkit_run_finished(self, report):
            finished.append(report)

    pset = meshkit.plugins.build_manager(plugins={"watch": Watch()})

    def progress(event):
        raise RuntimeError("a bug in a progress callback")

    with pytest.raises(RuntimeError, match="a bug in a progress callback"):
        Runner(str(path), pset=pset, progress=progress).run()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is False
    assert "RuntimeError: a bug in a progress callback" in summary["error"]
    assert finished and finished[-1].ok is False


def test_a_worker_error_reply_still_stops_a_federated_run():
    # (guard for the min_clients change: a task error is not a lost peer)
    class Broken(Rows):
        def fit(self, state, x, y, *, seed):
            raise ValueError("shape mismatch")

    ctx = make_ctx(Broken(8), ranks=(1, 2))
    with pytest.raises(MeshError, match="shape mismatch"):
        meshkit.plugins.create("strategy", "federated", {"rounds": 1}).run(ctx)


def test_a_run_report_with_numpy_metrics_still_writes_its_summary():
    from meshkit.train import RunReport

    report = RunReport(ok=True, out="o", strategy="federated", rounds=1, rounds_completed=1,
                       metrics={"loss": np.float32(0.5), "accuracy": np.float64(0.75)})
    assert json.loads(json.dumps(report.to_json()))["metrics"] == {"loss": 0.5,
                                                                    "accuracy": 0.75}


def _resume_fixture(tmp_path, metrics_rounds):
    from meshkit.train import read_metrics
    from meshkit.train._runner import _identity

    out = tmp_path / "out"
    path = write(tmp_path, f"""
        [run]
        out = "{out}"
        [strategy]
        rounds = 4
    """)
    plan = check(path)
    parts = build_components(plan)
    state = parts["task"].init_state(0)
    line = {"round": 2, "rounds": 4, "strategy": "federated", "answered": [1, 2],
            "accuracy": 0.5}
    save_checkpoint(out, Checkpoint(round=2, state=state, identity=_identity(plan),
                                    rng_state=parts["rng"].bit_generator.state, report=line))
    (out / "metrics.jsonl").write_text("".join(
        json.dumps({**line, "round": r}) + "\n" for r in metrics_rounds))
    start, resumed = Runner(str(path), resume=True)._prepare_out(plan, out, parts)
    assert (start, resumed) == (2, True)
    return read_metrics(out)


def test_a_crash_between_checkpoint_and_metrics_line_leaves_no_gap_after_resume(tmp_path):
    rows = _resume_fixture(tmp_path, metrics_rounds=[1])
    assert [r["round"] for r in rows] == [1, 2]
    assert rows[1]["accuracy"] == 0.5


def test_resume_neither_duplicates_nor_keeps_rounds_past_the_checkpoint(tmp_path):
    rows = _resume_fixture(tmp_path, metrics_rounds=[1, 2, 3])
    assert [r["round"] for r in rows] == [1, 2]


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path):
    path = tmp_path / "c.toml"
    path.write_bytes(b"\xff\xfe[run]\n")
    with pytest.raises(ConfigError, match="not valid TOML: TOML files are UTF-8"):
        load_config(path)


def test_data_parallel_min_workers_above_the_worker_count_is_refused_before_the_run():
    strategy = meshkit.plugins.create("strategy", "data-parallel", {"min_workers": 3})
    with pytest.raises(ConfigError, match="min_workers = 3 but there are only 2 workers"):
        strategy.check(task=Rows(8), outer_name="average", workers=2)


def test_a_worker_that_cannot_build_the_task_says_why_instead_of_stalling():
    import threading
    import uuid

    from meshkit.node.config import NodeConfig
    from meshkit.train import GroupPool, serve_trainer

    hub = f"inproc://{uuid.uuid4().hex}"
    groups = {}

    def join(rank):
        cfg = NodeConfig(rank=rank, world=2, peers=[hub], transport="inproc",
                         secret=b"s" * 32, timeout=3.0, topology="star")
        groups[rank] = meshkit.plugins.create("transport", "inproc").connect(cfg)

    joiners = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in joiners:
        t.start()
    for t in joiners:
        t.join(10)
    raised = []

    def worker():
        # This worker's [task] options are refused (a node-local problem).
        try:
            serve_trainer(groups[1], {"task": "digits", "task_options": {"hidden": -1},
                                      "seed": 0})
        except MeshError as exc:
            raised.append(exc)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    try:
        groups[0].wait_for_workers(10)
        ctx = StrategyContext(
            task=meshkit.plugins.create("task", "digits"),
            aggregator=meshkit.plugins.create("aggregator", "fedavg"),
            pool=GroupPool(groups[0]), workers=[1], rng=np.random.default_rng(0),
            outer=meshkit.plugins.create("outer_optimizer", "average"), timeout=3.0)
        with pytest.raises(MeshError) as err:
            meshkit.plugins.create("strategy", "federated", {"rounds": 1}).run(ctx)
        assert type(err.value) is MeshError
        assert "rank 1: cannot build the task on this worker" in str(err.value)
        assert "hidden must be positive" in str(err.value)
        ctx.pool.stop_all([1])
        thread.join(10)
        assert raised and "hidden" in str(raised[0])
    finally:
        for g in groups.values():
            g.close()


def test_resume_refuses_a_checkpoint_whose_model_does_not_fit_the_task_options(tmp_path):
    from meshkit.train._runner import _identity

    out = tmp_path / "out"
    made = check(write(tmp_path, f'[run]\nout = "{out}"\n[task]\nhidden = 32\n', "a.toml"))
    parts = build_components(made)
    save_checkpoint(out, Checkpoint(round=1, state=parts["task"].init_state(0),
                                    identity=_identity(made)))
    changed = check(write(tmp_path, f'[run]\nout = "{out}"\n[task]\nhidden = 64\n', "b.toml"))
    with pytest.raises(ConfigError) as err:
        Runner(str(changed.config.path), resume=True)._prepare_out(
            changed, out, build_components(changed))
    message = str(err.value)
    assert "does not fit the task this config builds" in message
    assert "hidden.w: checkpoint shape (64, 32), this config's task (64, 64)" in message


@pytest.mark.parametrize("fraction, empty", [(0.0002, "test"), (0.9998, "training")])
def test_a_digits_split_that_leaves_a_side_empty_is_refused(fraction, empty):
    with pytest.raises(ConfigError, match=f"leaving an empty {empty} set"):
        create_task("digits", {"test_fraction": fraction})
