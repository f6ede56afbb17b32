"""One broken plugin never bricks the CLI (issue 13, DESIGN §3 and §7).

The installed fixture package meshkit-hello ships a plugin for each way a
plugin breaks: one that fails to import (hello-broken), one with a misspelt
hook (hello-typo), one whose aggregator hook raises (hello-raising), one whose
task hook returns junk (hello-junk) and one offering a name a built-in offers
(hello-clash). With all of them installed, `meshkit plugins` lists every
healthy component beside them, configs that use healthy components work, and
a config that selects a broken or conflicting component is a clean error.
"""

from __future__ import annotations

import json
import textwrap

from tests.support.cli import run_cli
BUILTINS_ONLY = """
[run]
task = "digits"
seed = 0
out = "runs/x"

[mesh]
workers = 2

[strategy]
name = "federated"
rounds = 2

[aggregator]
name = "fedavg"

[outer_optimizer]
name = "nesterov"
"""


def _write(tmp_path, text, name="job.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def _assert_clean_error(result, *fragments):
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def test_plugins_lists_every_healthy_component_beside_each_broken_plugin(hello_site):
    result = run_cli("plugins", pythonpath=hello_site)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for healthy in ("fedavg", "nesterov", "digits", "tcp", "hello-scaled", "hello-sum"):
        assert any(line.split()[1:2] == [healthy] for line in out.splitlines()), healthy
    assert ("failed  hello-raising (meshkit-hello 1.2.3): hook meshkit_aggregators() raised "
            "RuntimeError: the FPGA driver is not loaded") in out
    assert ("failed  hello-junk (meshkit-hello 1.2.3): hook meshkit_tasks() must return an "
            "iterable of meshkit.Component records, got 'hello-junk-task'") in out
    assert "failed  hello-broken (meshkit-hello 1.2.3): ImportError" in out
    assert "failed  hello-typo (meshkit-hello 1.2.3)" in out
    # The conflicting name is listed once, as a conflict naming both providers,
    # and not as a component of either.
    assert ("conflict  two plugins offer the outer_optimizer 'average': plugin 'hello-clash' "
            "(meshkit-hello 1.2.3) and plugin 'outer' (meshkit 0.1.0)") in out
    assert not any(line.split()[:2] == ["outer_optimizer", "average"]
                   for line in out.splitlines())
    # A plugin whose only hook broke is not passed off as an observer.
    assert "observer  hello-raising" not in out and "observer  hello-junk" not in out


def test_plugins_json_carries_components_failures_and_conflicts(hello_site):
    result = run_cli("plugins", "--json", pythonpath=hello_site)
    assert result.returncode == 0, result.stderr
    listing = json.loads(result.stdout)
    names = {(r["kind"], r["name"]) for r in listing["components"]}
    assert {("aggregator", "fedavg"), ("outer_optimizer", "nesterov"),
            ("outer_optimizer", "hello-scaled")} <= names
    assert ("outer_optimizer", "average") not in names
    failed = {f["plugin"]: f for f in listing["failed"]}
    assert failed["hello-raising"]["hook"] == "meshkit_aggregators"
    assert failed["hello-raising"]["distribution"] == "meshkit-hello"
    assert "RuntimeError: the FPGA driver is not loaded" in failed["hello-raising"]["error"]
    assert failed["hello-junk"]["hook"] == "meshkit_tasks"
    assert failed["hello-broken"]["hook"] is None
    (conflict,) = listing["conflicts"]
    assert (conflict["kind"], conflict["name"]) == ("outer_optimizer", "average")
    assert [(p["plugin"], p["distribution"]) for p in conflict["providers"]] == [
        ("hello-clash", "meshkit-hello"), ("outer", "meshkit")]


def test_a_raising_aggregator_hook_does_not_fail_a_config_of_builtins(hello_site, tmp_path):
    result = run_cli("check", _write(tmp_path, BUILTINS_ONLY), pythonpath=hello_site)
    assert result.returncode == 0, result.stderr
    assert "aggregator: fedavg from plugin 'aggregators' (meshkit 0.1.0)" in result.stdout
    assert result.stdout.rstrip().endswith("ok")


def test_selecting_a_component_of_a_plugin_whose_hook_raised_quotes_the_failure(
        hello_site, tmp_path):
    config = _write(tmp_path, BUILTINS_ONLY.replace('name = "fedavg"', 'name = "fpga-mean"'))
    result = run_cli("check", config, pythonpath=hello_site)
    _assert_clean_error(result, config, "[aggregator] name: no aggregator named 'fpga-mean'",
                        "plugin 'hello-raising' from meshkit-hello 1.2.3: hook "
                        "meshkit_aggregators() raised RuntimeError: the FPGA driver is not "
                        "loaded")


def test_selecting_a_name_two_plugins_offer_names_both_providers(hello_site, tmp_path):
    config = _write(tmp_path, BUILTINS_ONLY.replace('name = "nesterov"', 'name = "average"'))
    result = run_cli("check", config, pythonpath=hello_site)
    _assert_clean_error(result, config, "[outer_optimizer] name: two plugins offer the "
                        "outer_optimizer 'average'", "plugin 'outer' (meshkit 0.1.0)",
                        "plugin 'hello-clash' (meshkit-hello 1.2.3)",
                        "MESHKIT_DISABLE_PLUGINS")
    # Blocking one provider makes the other's selectable again.
    ok = run_cli("check", config, pythonpath=hello_site,
                 env={"MESHKIT_DISABLE_PLUGINS": "hello-clash"})
    assert ok.returncode == 0, ok.stderr
    assert "outer_optimizer: average from plugin 'outer' (meshkit 0.1.0)" in ok.stdout


def test_a_misspelt_component_name_gets_a_suggestion(tmp_path):
    config = _write(tmp_path, BUILTINS_ONLY.replace('name = "fedavg"', 'name = "fedagv"'))
    result = run_cli("check", config)
    _assert_clean_error(result, config, "[aggregator] name: no aggregator named 'fedagv' "
                        "(did you mean 'fedavg'?); available: allreduce, bulyan, "
                        "centered-clipping, fedavg, fedprox")


def test_a_misspelt_key_gets_a_suggestion_naming_file_table_and_key(tmp_path):
    config = _write(tmp_path, BUILTINS_ONLY.replace("rounds = 2", "runds = 2"))
    result = run_cli("check", config)
    _assert_clean_error(result, config, "[strategy] runds: unknown key (did you mean 'rounds'?)")

    config = _write(tmp_path, BUILTINS_ONLY.replace("workers = 2", "wrokers = 2"))
    _assert_clean_error(run_cli("check", config), config,
                        "[mesh] wrokers: unknown key (did you mean 'workers'?)")


def test_a_misspelt_table_gets_a_suggestion(tmp_path):
    config = _write(tmp_path, BUILTINS_ONLY.replace("[outer_optimizer]", "[outer_optimiser]"))
    _assert_clean_error(run_cli("check", config), config,
                        "[outer_optimiser]: unknown table (did you mean [outer_optimizer]?)")


def test_a_misspelt_board_option_gets_a_suggestion():
    # The board is built before the node dials anyone: nothing listens on port 9.
    result = run_cli("node", "--board", "loopback", "--board-option", "stage_di=enc0",
                     "--rank", "1", "--world", "2", "--peers", "127.0.0.1:9",
                     env={"MESHKIT_SECRET": "a-test-secret-of-32-characters!!"})
    _assert_clean_error(result, "[board] stage_di: unknown key (did you mean 'stage_id'?)")
