"""Populations (meshkit.population): a run over clients that are rows, made when served."""

from __future__ import annotations

import json
import textwrap
import tracemalloc

import numpy as np
import pytest

import meshkit
from meshkit import ConfigError
from meshkit.population import client_rows_of, population_size
from meshkit.task import create_task
from meshkit.train import LocalPool, StrategyContext, Trainer, read_metrics

from tests.support.cli import run_cli

N = 100_000


def _task(**options):
    return create_task("synthetic-federated", {"clients": N, "dim": 10, "classes": 4,
                                               "hidden": 4, "eval_clients": 4, **options})


def _ctx(ranks, **kw):
    trainers = {r: Trainer(_task()) for r in ranks}
    return StrategyContext(task=_task(), aggregator=meshkit.plugins.create("aggregator", "fedavg"),
                           pool=LocalPool(trainers), workers=list(ranks),
                           rng=np.random.default_rng(0),
                           outer=meshkit.plugins.create("outer_optimizer", "average"), **kw)


def _federated(**options):
    return meshkit.plugins.create("strategy", "federated",
                                  {"rounds": 3, "fraction": 20 / N, **options})


def test_a_run_has_the_populations_clients_and_the_same_bits_on_one_or_three_workers():
    one = _federated().run(_ctx([1]))
    three = _federated().run(_ctx([1, 2, 3]))
    for key, value in one.state.items():
        assert np.array_equal(value, three.state[key]), key
    assert _federated().clients(2, None, _task()) == N


def test_strategy_clients_that_disagree_with_the_population_are_refused():
    with pytest.raises(ConfigError, match="population of 100000 clients; leave clients out"):
        _federated(clients=500).clients(2, None, _task())


def test_a_worker_keeps_no_clients_data_between_fits():
    trainer = Trainer(_task())
    state = trainer.task.init_state(0)
    trainer.handle({"op": "set_state", "state": state, "seq": 1})

    def fits(first):
        for c in range(first, first + 100):
            reply = trainer.handle({"op": "fit", "shard": c * 397 % N, "shards": N, "seed": c,
                                    "seq": 2})
            assert "error" not in reply, reply
    fits(0)  # warm: the task's pooled evaluation rows, numpy's caches
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    fits(1000)
    grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    tracemalloc.stop()
    # 100 clients (a mean of ~100 rows of 10 float32 features each) would be ~400 KB if kept
    assert grown < 128 * 1024, f"the worker grew by {grown} bytes over 100 fits"


def test_a_client_beyond_the_population_is_refused_by_number():
    with pytest.raises(ConfigError, match=f"client {N} of {N + 1}.*{N} clients"):
        client_rows_of(_task(), N, N + 1)
    assert population_size(_task()) == N


def _config(tmp_path, extra=""):
    path = tmp_path / "pop.toml"
    path.write_text(textwrap.dedent(f"""
        [run]
        task = "synthetic-federated"
        out = "{tmp_path / 'run'}"

        [mesh]
        launch = "local"
        workers = 2

        [strategy]
        name = "federated"
        rounds = 2
        fraction = {20 / N}
        evaluate = "both"

        [task]
        clients = {N}
        dim = 10
        classes = 4
        eval_clients = 4
    """) + textwrap.dedent(extra))
    return path


def _check(*args):
    from click.testing import CliRunner

    from meshkit.cli import main

    return CliRunner().invoke(main, ["check", *args])


def test_check_summarises_a_population_from_a_seeded_sample(tmp_path):
    done = _check("--json", str(_config(tmp_path)))
    assert done.exit_code == 0, done.output
    plan = json.loads(done.output)
    assert plan["client_count"] == N and len(plan["clients"]) == 100
    assert plan["clients_sampled"].startswith(f"100 of {N} clients made (drawn with the run seed)")
    text = _check(str(_config(tmp_path))).output
    assert f"clients: {N} (the task's population); 100 of {N} clients made" in text


def test_a_partitioner_table_with_a_population_is_refused(tmp_path):
    done = _check(str(_config(tmp_path, '[partitioner]\nname = "iid"\n')))
    assert done.exit_code == 2
    assert "is a population" in done.output and "Remove the [partitioner] table" in done.output


@pytest.mark.slow
def test_meshkit_run_trains_a_population_of_100000_on_real_workers(tmp_path):
    """And streams per-client figures to clients.jsonl, with a progress line every 2 rounds."""
    config = _config(tmp_path).read_text().replace(
        'out = ', 'progress_every = 2\nclient_metrics = "file"\nout = ').replace(
        "rounds = 2", "rounds = 3")
    (tmp_path / "pop.toml").write_text(config)
    done = run_cli("run", str(tmp_path / "pop.toml"), timeout=120)
    assert done.returncode == 0, done.stderr + done.stdout
    shown = [line.split("/")[0].split()[-1] for line in done.stdout.splitlines()
             if line.startswith("round ")]
    assert shown == ["2", "3"]  # every 2nd round, and the last
    rows = read_metrics(tmp_path / "run")
    assert [r["round"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert len(row["clients"]) == 20 and max(row["clients"]) < N
        assert np.isfinite(row["client_accuracy"]) and np.isfinite(row["accuracy"])
        assert "client_metrics" not in row and "served" not in row
    lines = [json.loads(line) for line in
             (tmp_path / "run" / "clients.jsonl").read_text().splitlines()]
    assert len(lines) == 60
    first = [line for line in lines if line["round"] == 1]
    assert sorted(line["client"] for line in first) == rows[0]["clients"]
    assert all({"rank", "examples", "accuracy", "loss"} <= set(line) for line in first)
