"""``meshkit run`` end to end with real worker processes on loopback."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest

import meshkit.plugins
from meshkit.checkpoint import load_checkpoint
from meshkit.train import Runner, read_metrics

from tests.support.cli import run_cli
from tests.support.configs import write_config
pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def outer_name() -> str:
    """FedAdam when installed (its state is checkpointed too), else plain averaging."""
    return "fedadam" if "fedadam" in meshkit.plugins.available("outer_optimizer") else "average"


def pids_of_workers(out: Path) -> list[int]:
    pids = []
    for log in sorted((out / "logs").glob("worker-*.log")):
        for line in log.read_text().splitlines():
            if line.startswith("{") and '"caps"' in line:
                pids.append(json.loads(line)["caps"]["pid"])
    return pids


def exited_within(pid: int, timeout: float) -> bool:
    """Wait (on the kernel's pidfd, not a sleep loop) for a non-child process to exit."""
    import select

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def kill_leftovers(out: Path) -> None:
    for pid in pids_of_workers(out):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# -- the quickstart and the examples ---------------------------------------------


@pytest.mark.skipif(outer_name() != "fedadam", reason="the fedadam outer optimizer is not "
                    "installed yet (examples/federated.toml selects it)")
def test_the_quickstart_runs_the_federated_example_to_its_stated_accuracy(tmp_path):
    result = run_cli("run", str(EXAMPLES / "federated.toml"), cwd=str(tmp_path), timeout=120)
    assert result.returncode == 0, result.stderr
    assert "round  30/30" in result.stdout and "done: federated" in result.stdout
    rows = read_metrics(tmp_path / "runs" / "federated")
    assert [r["round"] for r in rows] == list(range(1, 31))
    # README states ~0.97 held-out accuracy; the floor is well below it.
    assert rows[-1]["accuracy"] >= 0.85

    # The model-parallel example serves that trained model through a
    # loopback board and two workers, and gets the same accuracy.
    served = run_cli("run", str(EXAMPLES / "model-parallel.toml"), cwd=str(tmp_path),
                     timeout=120)
    assert served.returncode == 0, served.stderr
    mp = read_metrics(tmp_path / "runs" / "model-parallel")
    assert mp[-1]["accuracy"] == pytest.approx(rows[-1]["accuracy"], abs=0.01)


def test_the_data_parallel_example_runs_and_learns(tmp_path):
    result = run_cli("run", str(EXAMPLES / "data-parallel.toml"), cwd=str(tmp_path), timeout=120)
    assert result.returncode == 0, result.stderr
    rows = read_metrics(tmp_path / "runs" / "data-parallel")
    assert len(rows) == 5 and rows[-1]["accuracy"] >= 0.85
    assert all(r["answered"] == [1, 2] for r in rows)


def test_the_model_parallel_example_threads_through_a_loopback_board(tmp_path):
    config = (EXAMPLES / "model-parallel.toml").read_text().replace(
        'state_from = "runs/federated"', 'state_from = ""')
    (tmp_path / "mp.toml").write_text(config)
    result = run_cli("run", "mp.toml", cwd=str(tmp_path), timeout=120)
    assert result.returncode == 0, result.stderr
    assert "rank 3 joined (fixed_function" in result.stderr
    rows = read_metrics(tmp_path / "runs" / "model-parallel")
    # The untrained model pushed through the pipeline scores what it scores
    # locally: the activation went scale (board) -> hidden -> output.
    task = meshkit.plugins.create("task", "digits", {})
    expected = task.evaluate(task.init_state(0))["accuracy"]
    assert rows[0]["accuracy"] == pytest.approx(expected)
    assert rows[0]["answered"] == [1, 2, 3]


# -- failing before anything starts ------------------------------------------------


def test_a_config_selecting_a_missing_plugin_fails_before_any_process_starts(tmp_path):
    out = tmp_path / "out"
    config = write_config(tmp_path / "c.toml", out, extra="").read_text()
    # (krum is built in now: a name no plugin offers.)
    (tmp_path / "c.toml").write_text(config + '\n[aggregator]\nname = "foolsgold"\n')
    result = run_cli("run", str(tmp_path / "c.toml"))
    assert result.returncode == 2
    assert "no aggregator named 'foolsgold'" in result.stderr and "fedavg" in result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists(), "nothing was started, nothing was written"


def test_a_refused_strategy_fails_before_any_process_starts(tmp_path):
    out = tmp_path / "out"
    config = write_config(tmp_path / "c.toml", out, strategy="population-based").read_text()
    (tmp_path / "c.toml").write_text(config.replace("rounds = 4", ""))
    result = run_cli("run", str(tmp_path / "c.toml"))
    assert result.returncode == 2
    assert "not a distribution strategy" in result.stderr
    assert not out.exists()


def test_a_strategy_that_cannot_work_with_the_selection_fails_before_any_process(tmp_path):
    out = tmp_path / "out"
    config = write_config(tmp_path / "c.toml", out, strategy="federated",
                          extra='local_keys = ["hidden.*"]')  # needs evaluate = "clients"
    with pytest.raises(meshkit.ConfigError) as err:
        Runner(str(config)).run()
    assert "set evaluate = \"clients\"" in str(err.value)
    assert str(config) in str(err.value)
    bad_partition = write_config(
        tmp_path / "m.toml", out, strategy="model-parallel",
        extra='[[strategy.partitions]]\nnodes = ["scale", "output"]\nrank = 1\n'
              '[[strategy.partitions]]\nnodes = ["hidden"]\nrank = 2')
    with pytest.raises(meshkit.ConfigError, match="interleaved"):
        Runner(str(bad_partition)).run()
    assert not out.exists()


# -- faults --------------------------------------------------------------------------


def test_killing_one_of_four_workers_mid_run_finishes_and_records_who_answered(tmp_path):
    out = tmp_path / "out"
    config = write_config(tmp_path / "c.toml", out, workers=4, rounds=4,
                          extra="min_clients = 2")
    procs = {}

    def on_round(report, state):
        if report.round == 1:
            procs[3].kill()
            procs[3].wait(10)

    report = Runner(str(config), on_workers=procs.update, on_round=on_round).run()
    assert report.ok and report.rounds_completed == 4
    rows = read_metrics(out)
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["answered"] == [1, 2, 3, 4]
    assert rows[1]["answered"] == [1, 2, 4] and rows[1]["dropped"] == [3]
    assert all(r["answered"] == [1, 2, 4] for r in rows[2:])
    assert 3 in report.dropped
    assert all(p.poll() is not None for p in procs.values()), "every worker was reaped"


def test_a_stalled_worker_is_dropped_and_the_round_completes(tmp_path):
    out = tmp_path / "out"
    config = write_config(tmp_path / "c.toml", out, workers=3, rounds=3, timeout=1.5,
                          extra="min_clients = 2")
    procs = {}

    def on_round(report, state):
        if report.round == 1:
            procs[2].send_signal(signal.SIGSTOP)

    try:
        report = Runner(str(config), on_workers=procs.update, on_round=on_round).run()
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    assert report.ok
    rows = read_metrics(out)
    assert rows[1]["answered"] == [1, 3] and rows[1]["dropped"] == [2]
    assert "stalled" in report.dropped[2] or "within" in report.dropped[2]


def test_too_few_survivors_stop_the_run_with_a_clear_error_and_the_checkpoint_intact(tmp_path):
    out = tmp_path / "out"
    config = write_config(tmp_path / "c.toml", out, workers=3, rounds=4,
                          extra="min_clients = 2")
    procs = {}

    def on_round(report, state):
        if report.round == 1:
            # One live worker would serve every client; none can serve any.
            for rank in (1, 2, 3):
                procs[rank].kill()
                procs[rank].wait(10)

    with pytest.raises(meshkit.MeshError) as err:
        Runner(str(config), on_workers=procs.update, on_round=on_round).run()
    message = str(err.value)
    assert "min_clients = 2" in message and "--resume" in message
    assert "no live worker left to serve it" in message
    assert load_checkpoint(out).round == 1
    assert [r["round"] for r in read_metrics(out)] == [1]
    assert all(p.poll() is not None for p in procs.values())


def test_ctrl_c_terminates_the_workers_and_keeps_the_checkpoint(tmp_path):
    out = tmp_path / "out"
    config = write_config(tmp_path / "c.toml", out, workers=2, rounds=5)
    procs = {}

    def on_round(report, state):
        if report.round == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Runner(str(config), on_workers=procs.update, on_round=on_round).run()
    assert all(p.poll() is not None for p in procs.values())
    assert load_checkpoint(out).round == 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is False and "interrupted" in summary["error"]


# -- resume and determinism ----------------------------------------------------------

KILLER = '''
import os, signal
from meshkit_tasks.digits import DigitsTask


class Killer(DigitsTask):
    """digits, but the coordinator process dies in round KILL_IN_ROUND's evaluation."""

    calls = 0

    def evaluate(self, state):
        Killer.calls += 1
        if str(Killer.calls) == os.environ.get("KILL_IN_ROUND"):
            os.kill(os.getpid(), getattr(signal, os.environ.get("KILL_WITH", "SIGKILL")))
        return super().evaluate(state)
'''


def test_resume_after_the_coordinator_is_killed_reaches_the_uninterrupted_state(tmp_path):
    (tmp_path / "killer.py").write_text(KILLER)
    extra = "clients = 4\nfraction = 0.5\nmin_clients = 2"
    outer = outer_name()
    straight = write_config(tmp_path / "straight.toml", tmp_path / "straight", rounds=5,
                            task="killer:Killer", extra=extra, outer=outer)
    crashed = write_config(tmp_path / "crashed.toml", tmp_path / "crashed", rounds=5,
                           task="killer:Killer", extra=extra, outer=outer)
    env = {"PYTHONPATH": str(tmp_path)}
    try:
        first = run_cli("run", str(crashed), cwd=str(tmp_path), timeout=120,
                        env={**env, "KILL_IN_ROUND": "3"})
        assert first.returncode == -signal.SIGKILL, first.stderr
        assert load_checkpoint(tmp_path / "crashed").round == 2
        # Orphaned by the kill, the workers notice the lost coordinator and leave.
        assert all(exited_within(pid, 20) for pid in pids_of_workers(tmp_path / "crashed"))
        resumed = run_cli("run", str(crashed), "--resume", cwd=str(tmp_path), timeout=120,
                          env=env)
        assert resumed.returncode == 0, resumed.stderr
        assert "resumed after round 2" in resumed.stdout
        assert "round   1/5" not in resumed.stdout and "round   3/5" in resumed.stdout
        whole = run_cli("run", str(straight), cwd=str(tmp_path), timeout=120, env=env)
        assert whole.returncode == 0, whole.stderr
    finally:
        kill_leftovers(tmp_path / "crashed")
    assert [r["round"] for r in read_metrics(tmp_path / "crashed")] == [1, 2, 3, 4, 5]
    a = load_checkpoint(tmp_path / "crashed")
    b = load_checkpoint(tmp_path / "straight")
    assert a.round == b.round == 5
    for key in b.state:
        assert np.array_equal(a.state[key], b.state[key]), key
    assert read_metrics(tmp_path / "crashed")[-1]["clients"] == read_metrics(
        tmp_path / "straight")[-1]["clients"]


def test_ctrl_c_on_the_cli_exits_130_and_resume_continues(tmp_path):
    (tmp_path / "killer.py").write_text(KILLER)
    config = write_config(tmp_path / "c.toml", tmp_path / "out", rounds=3, workers=2,
                          task="killer:Killer")
    env = {"PYTHONPATH": str(tmp_path)}
    first = run_cli("run", str(config), cwd=str(tmp_path), timeout=120,
                    env={**env, "KILL_IN_ROUND": "2", "KILL_WITH": "SIGINT"})
    assert first.returncode == 130, first.stderr
    assert "interrupted" in first.stderr and "Traceback" not in first.stderr
    assert load_checkpoint(tmp_path / "out").round == 1
    resumed = run_cli("run", str(config), "--resume", cwd=str(tmp_path), timeout=120, env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert [r["round"] for r in read_metrics(tmp_path / "out")] == [1, 2, 3]


def test_the_same_config_and_seed_give_the_same_final_state_twice(tmp_path):
    states = []
    for name in ("a", "b"):
        config = write_config(tmp_path / f"{name}.toml", tmp_path / name, rounds=3,
                              extra="clients = 5\nfraction = 0.6", outer=outer_name())
        states.append(Runner(str(config)).run().state)
    assert states[0].keys() == states[1].keys()
    for key in states[0]:
        assert np.array_equal(states[0][key], states[1][key]), key


def test_resume_refuses_a_checkpoint_from_a_different_run(tmp_path):
    out = tmp_path / "out"
    Runner(str(write_config(tmp_path / "a.toml", out, rounds=1, workers=1))).run()
    other = write_config(tmp_path / "b.toml", out, rounds=1, workers=1, strategy="local")
    with pytest.raises(meshkit.ConfigError, match="belongs to a different run"):
        Runner(str(other), resume=True).run()
    missing = write_config(tmp_path / "c.toml", tmp_path / "empty", rounds=1, workers=1)
    with pytest.raises(meshkit.ConfigError, match="nothing to resume from"):
        Runner(str(missing), resume=True).run()


def test_resume_with_more_rounds_trains_on_to_the_state_of_the_longer_run(tmp_path):
    extra = "clients = 4\nfraction = 0.5"
    short = write_config(tmp_path / "short.toml", tmp_path / "out", rounds=2, workers=2,
                         extra=extra, outer=outer_name())
    Runner(str(short)).run()
    longer = write_config(tmp_path / "long.toml", tmp_path / "out", rounds=4, workers=2,
                          extra=extra, outer=outer_name())
    resumed = Runner(str(longer), resume=True).run()
    whole = Runner(str(write_config(tmp_path / "whole.toml", tmp_path / "whole", rounds=4,
                                    workers=2, extra=extra, outer=outer_name()))).run()
    assert resumed.resumed_from == 2  # it trained rounds 3-4 only
    assert [r["round"] for r in read_metrics(tmp_path / "out")] == [1, 2, 3, 4]
    for key in whole.state:
        assert np.array_equal(resumed.state[key], whole.state[key]), key


# -- observers -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def observed_run(tmp_path_factory):
    """One federated run of 2 workers and 2 rounds, watched by an observer plugin.

    Shared by the observer test and the run-directory test, which asked for
    the same config (each run costs a coordinator and two ``meshkit node``
    processes)."""
    tmp_path = tmp_path_factory.mktemp("observed")
    seen = []

    class Observer:
        @meshkit.hookimpl
        def meshkit_run_started(self, config):
            seen.append(("started", config.strategy.name))

        @meshkit.hookimpl
        def meshkit_round_completed(self, report):
            seen.append(("round", report.round, report.answered))

        @meshkit.hookimpl
        def meshkit_run_finished(self, report):
            seen.append(("finished", report.ok, report.rounds_completed))

    pset = meshkit.plugins.build_manager(plugins={"observer": Observer()})
    out = tmp_path / "out"
    config = write_config(tmp_path / "c.toml", out, rounds=2, workers=2)
    report = Runner(str(config), pset=pset).run()
    return report, out, seen


def test_observer_hooks_fire_at_start_each_round_and_end(observed_run):
    _, _, seen = observed_run
    assert seen == [("started", "federated"), ("round", 1, (1, 2)), ("round", 2, (1, 2)),
                    ("finished", True, 2)]


def test_the_run_directory_holds_metrics_checkpoint_summary_and_a_plot(observed_run):
    report, out, _ = observed_run
    rows = read_metrics(out)
    assert [set(r) >= {"round", "answered", "dropped", "clients", "examples", "seconds",
                       "loss", "accuracy", "train_loss"} for r in rows] == [True, True]
    ckpt = load_checkpoint(out)
    assert ckpt.round == 2 and ckpt.identity["seed"] == 7
    assert all(np.array_equal(ckpt.state[k], report.state[k]) for k in report.state)
    assert json.loads((out / "summary.json").read_text())["ok"] is True
    assert not list(out.glob(".checkpoint-*")), "no temporary file is left behind"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not (out / "report.png").exists()
    else:
        assert (out / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_meshkit_coordinator_drives_nodes_started_elsewhere(tmp_path):
    import subprocess
    import sys

    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef0123456789abcdef")
    secret.chmod(0o600)
    config = write_config(tmp_path / "c.toml", tmp_path / "out", workers=2, rounds=2)
    config.write_text(config.read_text().replace(
        'launch = "local"', f'launch = "external"\nsecret_file = "{secret}"'))
    env = {k: v for k, v in os.environ.items() if k != "MESHKIT_SECRET"}
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "meshkit", "coordinator", str(config)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    nodes = []
    try:
        first = coordinator.stdout.readline()  # "coordinator listening on HOST:PORT ..."
        assert first.startswith("coordinator listening on "), first
        address = first.split()[3]
        for rank in (1, 2):
            nodes.append(subprocess.Popen(
                [sys.executable, "-m", "meshkit", "node", "--rank", str(rank), "--world", "3",
                 "--peers", address, "--secret-file", str(secret)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        out, err = coordinator.communicate(timeout=60)
        assert coordinator.returncode == 0, err
        assert "done: federated, 2 round(s)" in out
        for node in nodes:
            node.wait(30)
            assert node.returncode == 0
    finally:
        for proc in (coordinator, *nodes):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert [r["answered"] for r in read_metrics(tmp_path / "out")] == [[1, 2], [1, 2]]


def test_an_external_run_without_a_secret_is_refused_before_it_listens(tmp_path):
    config = write_config(tmp_path / "c.toml", tmp_path / "out", workers=2, rounds=1)
    result = run_cli("coordinator", str(config))
    assert result.returncode == 2
    assert "secret" in result.stderr and "MESHKIT_SECRET" in result.stderr
