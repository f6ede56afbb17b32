"""A broken plugin costs only itself (issue 13, DESIGN §3).

Component hooks that raise, return junk or offer a taken name are isolated by
the registry; observers whose event hooks raise are isolated by
``meshkit.plugins.notify``. Fixture-built plugin sets (no entry points), then
real runs at the end.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import types

import pytest

import meshkit
from meshkit.errors import PluginError, UnknownComponentError
from meshkit.plugins import EVENT_HOOKS, build_manager, notify

from tests.support.cli import run_cli
def _plugin(name: str, **hooks) -> types.SimpleNamespace:
    ns = types.SimpleNamespace(__name__=name)
    for hook, fn in hooks.items():
        setattr(ns, hook, meshkit.hookimpl(fn))
    return ns


def _records(*names):
    return lambda: [meshkit.Component(n, lambda n=n: n) for n in names]


def _explode():
    raise RuntimeError("the FPGA driver is not loaded")


def _raising_generator():
    yield meshkit.Component("half", lambda: "half")
    raise OSError("vendor SDK went away")


# -- component hooks ------------------------------------------------------------


def test_a_raising_component_hook_leaves_every_other_plugin_selectable():
    pset = build_manager({
        "healthy": _plugin("healthy", meshkit_aggregators=_records("mean", "median")),
        "fragile": _plugin("fragile", meshkit_aggregators=_explode,
                           meshkit_tasks=_records("fragile-task")),
    }, entry_points=False)
    assert list(pset.available("aggregator")) == ["mean", "median"]
    assert pset.create("aggregator", "median") == "median"
    # The broken plugin's other hooks still work.
    assert pset.create("task", "fragile-task") == "fragile-task"
    (failure,) = pset.failures
    assert (failure.name, failure.hook) == ("fragile", "meshkit_aggregators")
    assert failure.describe() == (
        "plugin 'fragile': hook meshkit_aggregators() raised RuntimeError: the FPGA driver "
        "is not loaded; its aggregator components are left out")


@pytest.mark.parametrize("result, fragment", [
    (lambda: "mean", "must return an iterable of meshkit.Component records, got 'mean'"),
    (lambda: meshkit.Component("mean", object),
     "must return an iterable of meshkit.Component records, got Component("),
    (lambda: {"mean": object}, "must return an iterable of meshkit.Component records, got {"),
    (lambda: 42, "must return an iterable of meshkit.Component records, got 42"),
    (lambda: [meshkit.Component("ok", object), ("mean", object)],
     "must return meshkit.Component records, got ('mean',"),
    (lambda: [meshkit.Component("twice", object), meshkit.Component("twice", object)],
     "offers the aggregator 'twice' twice"),
    (_raising_generator, "raised OSError: vendor SDK went away"),
], ids=["a-string", "one-record", "a-dict", "a-number", "a-tuple-inside", "a-name-twice",
        "a-generator-that-raises"])
def test_a_hook_returning_junk_is_a_failure_of_that_plugin_only(result, fragment):
    pset = build_manager({
        "junk": _plugin("junk", meshkit_aggregators=result),
        "healthy": _plugin("healthy", meshkit_aggregators=_records("fedavg")),
    }, entry_points=False)
    # Nothing of a broken answer is used, not even its well-formed part.
    assert list(pset.available("aggregator")) == ["fedavg"]
    (failure,) = pset.failures
    assert failure.name == "junk" and fragment in failure.error, failure.error


def test_a_hook_returning_none_offers_nothing_and_is_no_failure():
    pset = build_manager([_plugin("quiet", meshkit_boards=lambda: None)], entry_points=False)
    assert pset.available("board") == {} and pset.failures == []


def test_selecting_a_name_a_broken_plugin_would_offer_quotes_its_failure():
    pset = build_manager({
        "healthy": _plugin("healthy", meshkit_aggregators=_records("mean")),
        "fragile": _plugin("fragile", meshkit_aggregators=_explode),
    }, entry_points=False)
    with pytest.raises(UnknownComponentError) as info:
        pset.create("aggregator", "fpga-sum")
    message = str(info.value)
    assert "no aggregator named 'fpga-sum'; available: mean" in message
    assert "note: plugin 'fragile': hook meshkit_aggregators() raised RuntimeError" in message


def test_a_failure_of_another_kind_is_not_quoted():
    pset = build_manager([_plugin("fragile", meshkit_boards=_explode,
                                  meshkit_aggregators=_records("mean"))], entry_points=False)
    pset.available("board")
    with pytest.raises(UnknownComponentError) as info:
        pset.create("aggregator", "median")
    assert "fragile" not in str(info.value)


def test_a_conflict_withholds_only_the_name_in_conflict():
    pset = build_manager({
        "builtin": _plugin("builtin", meshkit_outer_optimizers=_records("average", "nesterov")),
        "impostor": _plugin("impostor", meshkit_outer_optimizers=_records("average", "lion")),
    }, entry_points=False)
    assert list(pset.available("outer_optimizer")) == ["lion", "nesterov"]
    (conflict,) = pset.conflicts()
    assert (conflict.kind, conflict.name) == ("outer_optimizer", "average")
    assert [p.plugin for p in conflict.providers] == ["builtin", "impostor"]
    assert pset.failures == []  # neither plugin is broken: the name is ambiguous
    with pytest.raises(PluginError, match=r"two plugins offer the outer_optimizer 'average': "
                                          r"plugin 'builtin' and plugin 'impostor'; neither "
                                          r"is used: uninstall one, or block one"):
        pset.create("outer_optimizer", "average")


def test_three_providers_of_one_name_are_all_named():
    pset = build_manager({n: _plugin(n, meshkit_boards=_records("fpga"))
                          for n in ("a", "b", "c")}, entry_points=False)
    with pytest.raises(PluginError, match="three plugins offer the board 'fpga': plugin 'a' "
                                          "and plugin 'b' and plugin 'c'"):
        pset.create("board", "fpga")


def test_hook_failures_are_not_repeated_when_a_plugin_registers_later():
    pset = build_manager([_plugin("fragile", meshkit_aggregators=_explode)],
                         entry_points=False)
    pset.available("aggregator")
    pset.register(_plugin("late", meshkit_aggregators=_records("mean")), "late")
    assert list(pset.available("aggregator")) == ["mean"]
    assert [f.name for f in pset.failures] == ["fragile"]


def test_a_misspelt_component_name_or_kind_gets_a_suggestion():
    pset = build_manager([_plugin("p", meshkit_aggregators=_records("fedavg", "allreduce"))],
                         entry_points=False)
    with pytest.raises(UnknownComponentError,
                       match=r"no aggregator named 'fedagv' \(did you mean 'fedavg'\?\); "
                             r"available: allreduce, fedavg"):
        pset.create("aggregator", "fedagv")
    with pytest.raises(UnknownComponentError, match=r"\(did you mean 'fedavg'\?\)"):
        pset.create("aggregator", "FedAvg")
    with pytest.raises(UnknownComponentError) as info:
        pset.create("aggregator", "krum")
    assert "did you mean" not in str(info.value)
    with pytest.raises(UnknownComponentError,
                       match=r"unknown component kind 'aggregators' \(did you mean "
                             r"'aggregator'\?\)"):
        pset.available("aggregators")


# -- event hooks ----------------------------------------------------------------


class _Recorder:
    def __init__(self):
        self.seen = []

    @meshkit.hookimpl
    def meshkit_round_completed(self, report):
        self.seen.append(report)

    @meshkit.hookimpl
    def meshkit_run_finished(self, report):
        self.seen.append(("finished", report))


class _Raising:
    @meshkit.hookimpl
    def meshkit_round_completed(self, report):
        raise ConnectionError(f"dashboard down at round {report}")


def test_the_event_hooks_are_the_specs_that_offer_no_component():
    assert EVENT_HOOKS == ("meshkit_node_joined", "meshkit_round_completed",
                           "meshkit_run_finished", "meshkit_run_started")


def test_a_raising_observer_is_logged_with_its_name_and_the_others_still_hear(caplog):
    before, after = _Recorder(), _Recorder()
    pset = build_manager({"before": before, "dashboard": _Raising(), "after": after},
                         entry_points=False)
    with caplog.at_level(logging.WARNING, logger="meshkit.plugins"):
        (failure,) = notify(pset, "meshkit_round_completed", report=1)
    assert before.seen == [1] and after.seen == [1]
    assert (failure.plugin, failure.hook, failure.count) == (
        "dashboard", "meshkit_round_completed", 1)
    assert failure.error == "ConnectionError: dashboard down at round 1"
    (record,) = caplog.records
    assert record.getMessage() == (
        "observer plugin 'dashboard': meshkit_round_completed() raised ConnectionError: "
        "dashboard down at round 1; meshkit went on without it; its later failures are "
        "counted, not reported")
    assert record.exc_info is not None  # the traceback, for the plugin's author


def test_a_repeatedly_raising_observer_is_recorded_once_and_counted(caplog):
    pset = build_manager({"dashboard": _Raising()}, entry_points=False)
    with caplog.at_level(logging.WARNING, logger="meshkit.plugins"):
        for round_ in range(1, 4):
            notify(pset, "meshkit_round_completed", report=round_)
    (failure,) = pset.observer_failures
    assert failure.count == 3 and failure.error.endswith("round 1")
    assert "(3 times)" in failure.describe()
    assert len(caplog.records) == 1  # one warning with a traceback, not one per round


class _NeverStarted:
    """An observer whose start hook fails (a tracking server down), so its round and
    finish hooks fail too, for a reason that is only a consequence."""

    def __init__(self):
        self.run = None

    @meshkit.hookimpl
    def meshkit_run_started(self, config):
        raise ConnectionError("tracking server 127.0.0.1:1 refused the connection")

    @meshkit.hookimpl
    def meshkit_round_completed(self, report):
        if self.run is None:
            raise RuntimeError("a round completed before meshkit_run_started created the run")

    @meshkit.hookimpl
    def meshkit_run_finished(self, report):
        if self.run is None:
            raise RuntimeError("the run finished before meshkit_run_started created the run")


def test_an_observer_that_failed_to_start_is_reported_once_with_the_real_cause(caplog):
    # Issue 35, item 11: the first, real cause once; not a report per round that buries it.
    pset = build_manager({"mlflow": _NeverStarted()}, entry_points=False)
    with caplog.at_level(logging.WARNING, logger="meshkit.plugins"):
        notify(pset, "meshkit_run_started", config=None)
        for round_ in range(1, 9):
            notify(pset, "meshkit_round_completed", report=round_)
        notify(pset, "meshkit_run_finished", report="done")
    (record,) = caplog.records
    assert record.getMessage().startswith(
        "observer plugin 'mlflow': meshkit_run_started() raised ConnectionError: tracking "
        "server 127.0.0.1:1 refused the connection; meshkit went on without it")
    # Every failure is still on record, counted, for whoever asks.
    assert [(f.hook, f.count) for f in pset.observer_failures] == [
        ("meshkit_run_started", 1), ("meshkit_round_completed", 8), ("meshkit_run_finished", 1)]


def test_notify_without_failures_returns_none():
    recorder = _Recorder()
    pset = build_manager({"r": recorder}, entry_points=False)
    assert notify(pset, "meshkit_run_finished", report="done") == []
    assert recorder.seen == [("finished", "done")] and pset.observer_failures == []


def test_an_interrupt_inside_an_observer_still_interrupts():
    class Interrupting:
        @meshkit.hookimpl
        def meshkit_run_started(self, config):
            raise KeyboardInterrupt

    pset = build_manager({"i": Interrupting()}, entry_points=False)
    with pytest.raises(KeyboardInterrupt):
        notify(pset, "meshkit_run_started", config=None)


def test_an_observer_written_as_a_wrapper_is_still_called():
    calls = []

    class Wrapping:
        @meshkit.hookimpl(wrapper=True)
        def meshkit_node_joined(self, caps):
            calls.append(("before", caps))
            result = yield
            calls.append(("after", caps))
            return result

    pset = build_manager({"w": Wrapping()}, entry_points=False)
    assert notify(pset, "meshkit_node_joined", caps="caps") == []
    assert calls == [("before", "caps"), ("after", "caps")]


def test_notify_refuses_a_hook_that_is_not_an_event():
    pset = build_manager([], entry_points=False)
    with pytest.raises(ValueError, match="'meshkit_aggregators' is not an event hook"):
        notify(pset, "meshkit_aggregators")


# -- over a real run --------------------------------------------------------------

RUN_CONFIG = """
[run]
task = "digits"
seed = 0
out = "{out}"

[mesh]
workers = 1

[strategy]
name = "federated"
rounds = 2
clients = 2

[aggregator]
name = "fedavg"

[outer_optimizer]
name = "nesterov"

[task]
hidden = 8
epochs = 1
"""

OBSERVER = """
import meshkit


class Dashboard:
    @meshkit.hookimpl
    def meshkit_round_completed(self, report):
        raise RuntimeError(f"dashboard down at round {report.round}")


observer = Dashboard()
"""


def _run_config(tmp_path) -> str:
    path = tmp_path / "job.toml"
    path.write_text(textwrap.dedent(RUN_CONFIG.format(out=tmp_path / "out")))
    return str(path)


def _assert_trained_through(result, tmp_path) -> None:
    assert result.returncode == 0, result.stdout + result.stderr
    assert "round   2/2" in result.stdout and "done: federated, 2 round(s)" in result.stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["ok"] is True and summary["rounds_completed"] == 2


@pytest.mark.slow
def test_a_raising_observer_from_a_fixture_built_plugin_set_does_not_stop_training(tmp_path):
    (tmp_path / "dashboard.py").write_text(textwrap.dedent(OBSERVER))
    code = textwrap.dedent("""
        import sys
        import meshkit.plugins as p
        from meshkit.cli import main
        import dashboard

        p.reset(p.build_manager({"dashboard": dashboard.observer}))
        main(sys.argv[1:])
    """)
    env = {k: v for k, v in os.environ.items()
           if k not in ("MESHKIT_PLUGINS", "MESHKIT_DISABLE_PLUGINS", "MESHKIT_SECRET")}
    env["PYTHONPATH"] = str(tmp_path)
    result = subprocess.run([sys.executable, "-c", code, "run", _run_config(tmp_path)],
                            capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    _assert_trained_through(result, tmp_path)
    assert ("observer plugin 'dashboard': meshkit_round_completed() raised RuntimeError: "
            "dashboard down at round 1; meshkit went on without it") in result.stderr


@pytest.mark.slow
def test_a_raising_observer_from_an_installed_package_does_not_stop_training(
        hello_site, tmp_path):
    # Every meshkit-hello plugin is loaded: the raising aggregator hook and the
    # junk task hook must not matter to a run of built-ins either.
    result = run_cli("run", _run_config(tmp_path), pythonpath=hello_site, cwd=str(tmp_path),
                     timeout=120)
    _assert_trained_through(result, tmp_path)
    # Its first failure is the one reported (with its traceback); the same plugin's
    # later failures, one per hook and round, are counted, not printed over it.
    assert ("observer plugin 'hello-observer' (meshkit-hello 1.2.3): meshkit_run_started() "
            "raised RuntimeError: the dashboard is unreachable (run started)") in result.stderr
    assert result.stderr.count("observer plugin 'hello-observer'") == 1, result.stderr
