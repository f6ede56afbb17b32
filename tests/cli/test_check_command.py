"""``meshkit check`` end to end: the resolved plan, and config errors as one clean paragraph.

Every check runs ``python -m meshkit`` in a subprocess, as a user would.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.support.cli import run_cli
HELLO_ONLY = {"MESHKIT_PLUGINS": "hello"}


GOOD_CONFIG = """
[run]
task = "hello-task"
seed = 3
out = "runs/hello"

[mesh]
transport = "hello-wire"
workers = 2

[strategy]
name = "hello-loop"
rounds = 4

[aggregator]
name = "hello-sum"

[outer_optimizer]
name = "hello-scaled"
factor = 0.5
"""


def _write(tmp_path, text, name="job.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def _assert_clean_error(result, *fragments):
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def test_selecting_a_component_of_a_failed_plugin_quotes_its_failure(hello_site, tmp_path):
    config = _write(tmp_path, GOOD_CONFIG.replace('name = "hello-sum"', 'name = "fpga-sum"'))
    result = run_cli("check", config, pythonpath=hello_site,
                     env={"MESHKIT_PLUGINS": "hello,hello-broken"})
    _assert_clean_error(result, "[aggregator] name: no aggregator named 'fpga-sum'",
                        "available: hello-sum",
                        "plugin 'hello-broken' from meshkit-hello 1.2.3 failed to load")


def test_check_prints_the_resolved_plan(hello_site, tmp_path):
    config = _write(tmp_path, GOOD_CONFIG)
    result = run_cli("check", config, pythonpath=hello_site, env=HELLO_ONLY)
    assert result.returncode == 0, result.stderr
    assert "strategy: hello-loop from plugin 'hello' (meshkit-hello 1.2.3) [rounds=4]" \
        in result.stdout
    assert "outer_optimizer: hello-scaled" in result.stdout and "factor=0.5" in result.stdout
    assert "world 3" in result.stdout
    assert result.stdout.rstrip().endswith("ok")


@pytest.mark.parametrize("edit, fragments", [
    (("rounds = 4", "rounds = 4\nrunds = 5"), ["[strategy] runds: unknown key"]),
    (("rounds = 4", 'rounds = "four"'), ["[strategy] rounds: expected an integer, got 'four'"]),
    (("workers = 2", "workers = 2\nwrokers = 3"), ["[mesh] wrokers: unknown key"]),
    (("seed = 3", "seed = 3.5"), ["[run] seed: expected an integer, got 3.5"]),
    (("factor = 0.5", "factor = 0.5\nlr = 1"), ["[outer_optimizer] lr: unknown key"]),
    (('name = "hello-sum"', 'name = "nope"'),
     ["[aggregator] name: no aggregator named 'nope'", "available: hello-sum"]),
    (('task = "hello-task"', 'task = "nope"'), ["[run] task: no task named 'nope'"]),
    (('[outer_optimizer]', '[outer]'), ["[outer]: unknown table"]),
    (('workers = 2', 'workers = 2\nlaunch = "cloud"'), ["[mesh]", "launch"]),
    (('[run]', '[run\n'), ["not valid TOML"]),
    (("workers = 2", "workers = 2\nresume_seconds = -1"), ["[mesh]", "resume_seconds"]),
    (("workers = 2", 'workers = 2\nresume_seconds = "soon"'), ["[mesh] resume_seconds"]),
    (("workers = 2", "workers = 2\nresume_bytes = -5"), ["[mesh]", "resume_bytes"]),
    (("workers = 2", 'workers = 2\nresume_seconds = 10\ntopology = "mesh"'),
     ["resume_seconds = 10 needs a star", "topology = 'mesh'"]),
    (("workers = 2", "workers = 2\nresume_seconds = 10\nrelays = 1"),
     ["resume_seconds = 10 needs a star", "relays = 1"]),
])
def test_a_bad_config_exits_2_naming_file_table_and_key(hello_site, tmp_path, edit, fragments):
    config = _write(tmp_path, GOOD_CONFIG.replace(*edit))
    result = run_cli("check", config, pythonpath=hello_site, env=HELLO_ONLY)
    _assert_clean_error(result, config, *fragments)


def test_a_multi_host_config_without_a_secret_is_refused(hello_site, tmp_path):
    config = _write(tmp_path, GOOD_CONFIG.replace("workers = 2", 'workers = 2\nlaunch = "external"'))
    result = run_cli("check", config, pythonpath=hello_site, env=HELLO_ONLY)
    _assert_clean_error(result, "[mesh] secret_file: required when launch = 'external'")


def test_a_missing_config_file_is_a_clean_error(tmp_path):
    result = run_cli("check", str(tmp_path / "absent.toml"))
    _assert_clean_error(result, "absent.toml: no such config file")


ROBUST_CONFIG = """
[run]
task = "digits"
out = "{out}"

[mesh]
workers = 2

[strategy]
name = "federated"
rounds = 2
clients = 10

[aggregator]
name = "{aggregator}"
{options}

[attack]
name = "scale"
clients = [3, 8]
factor = 5.0
"""


def test_check_says_a_robust_rule_holds_every_contribution_and_names_the_attackers(tmp_path):
    config = _write(tmp_path, ROBUST_CONFIG.format(out=tmp_path / "out", aggregator="krum",
                                                   options="f = 2"))
    result = run_cli("check", config)
    assert result.returncode == 0, result.stderr
    assert ("aggregation: krum holds every contribution of a round at once (O(cohort x "
            "model): all 10 clients, up to 10 x the model, 192,800 bytes") in result.stdout
    assert "attack: scale from plugin 'attacks'" in result.stdout
    assert "attackers: clients [3, 8] run scale" in result.stdout


@pytest.mark.parametrize("aggregator, options, fragment", [
    ("multi-krum", "", "f must be at least 1 when m = 0: f = 0 and m = 0 average every "
                       "contribution, which is plain fedavg"),
    ("multi-krum", "f = 0", "f must be at least 1 when m = 0"),
    ("bulyan", "", "f must be at least 1: with f = 0 bulyan keeps every contribution"),
])
def test_check_refuses_a_robust_rule_whose_defaults_are_the_plain_mean(tmp_path, aggregator,
                                                                       options, fragment):
    # With [attack] configured, multi-krum's f = 0, m = 0 was fedavg without a word (issue 35).
    config = _write(tmp_path, ROBUST_CONFIG.format(out=tmp_path / "out", aggregator=aggregator,
                                                   options=options))
    _assert_clean_error(run_cli("check", config), config, "[aggregator] f: invalid value: "
                        + fragment, "Set f to the attackers a round may hold")


def test_check_accepts_multi_krum_keeping_m_with_f_0(tmp_path):
    config = _write(tmp_path, ROBUST_CONFIG.format(out=tmp_path / "out", aggregator="multi-krum",
                                                   options="m = 3"))
    result = run_cli("check", config)
    assert result.returncode == 0, result.stderr


def test_check_counts_a_rounds_cohort_not_every_client(tmp_path):
    # A round of 3 sampled clients holds 3 contributions, not the run's 10 (issue 35, item 13).
    config = _write(tmp_path, ROBUST_CONFIG.format(out=tmp_path / "out", aggregator="median",
                                                   options="").replace(
        "clients = 10", "clients = 10\nfraction = 0.3"))
    result = run_cli("check", config)
    assert result.returncode == 0, result.stderr
    assert ("aggregation: median holds every contribution of a round at once (O(cohort x "
            "model): a round's cohort of 3 of the 10 clients, up to 3 x the model, 57,840 "
            "bytes") in result.stdout


def test_check_says_norm_bound_streams(tmp_path):
    config = _write(tmp_path, ROBUST_CONFIG.format(out=tmp_path / "out",
                                                   aggregator="norm-bound",
                                                   options="max_norm = 0.5"))
    result = run_cli("check", config, "--json")
    assert result.returncode == 0, result.stderr
    import json
    plan = json.loads(result.stdout)
    assert plan["aggregation"] == {"holds_every_contribution": False, "contributions": 1,
                                   "clients": 10,
                                   "bytes": 19280}
    assert plan["attack"] == {"name": "scale", "clients": [3, 8]}


def test_check_refuses_an_attacker_that_is_not_a_client(tmp_path):
    config = _write(tmp_path, ROBUST_CONFIG.format(out=tmp_path / "out", aggregator="median",
                                                   options="").replace("[3, 8]", "[3, 12]"))
    _assert_clean_error(run_cli("check", config), "[attack] clients: [12] are not clients")


FAILURES_CONFIG = """
[run]
task = "digits"
out = "runs/failures"

[mesh]
workers = 3

[strategy]
name = "federated"
rounds = 2
{line}
"""


def test_check_states_what_a_member_failure_costs(tmp_path):
    accepted = run_cli("check", _write(tmp_path, FAILURES_CONFIG.format(line="")),
                       cwd=str(tmp_path))
    assert accepted.returncode == 0, accepted.stderr
    assert "accept_failures=True" in accepted.stdout
    assert ("member failures: accepted (accept_failures = true): a failing rank sits out the "
            "round") in accepted.stdout
    assert "a rank failing in 3 rounds is quarantined for the run" in accepted.stdout
    strict = run_cli("check", _write(tmp_path, FAILURES_CONFIG.format(
        line="accept_failures = false")), cwd=str(tmp_path))
    assert strict.returncode == 0, strict.stderr
    assert "member failures: accept_failures = false: any member's error reply" in strict.stdout
    wrong = run_cli("check", _write(tmp_path, FAILURES_CONFIG.format(
        line='accept_failures = "yes"')), cwd=str(tmp_path))
    _assert_clean_error(wrong, "[strategy]", "accept_failures")


PRIVATE_SECURE = """
[run]
task = "digits"
out = "{out}"

[mesh]
workers = 3

[strategy]
name = "federated"
rounds = 2
clients = 6

[aggregator]
name = "{aggregator}"
{options}

[privacy]
{privacy}

[secure_aggregation]
name = "secagg+"
"""


def test_dp_with_secure_aggregation_suggests_what_both_accept(tmp_path):
    # Issue 35, item 7: the DP refusal's advice must not be refused by the secure round next.
    config = _write(tmp_path, PRIVATE_SECURE.format(
        out=tmp_path / "out", aggregator="norm-bound", options="max_norm = 1.0",
        privacy='name = "dp-fixed"\nclip_norm = 1.0\nnoise_multiplier = 1.0\nclip = "client"'))
    result = run_cli("check", config)
    _assert_clean_error(result, config, "[privacy] name = 'dp-fixed' with [aggregator] name = "
                        "'norm-bound'", "With [secure_aggregation] name = 'secagg+' as well, use "
                        "a linear aggregator (fedavg), the one kind both accept")
    # ... and following it, the run checks.
    fixed = _write(tmp_path, PRIVATE_SECURE.format(
        out=tmp_path / "out", aggregator="fedavg", options="",
        privacy='name = "dp-fixed"\nclip_norm = 1.0\nnoise_multiplier = 1.0\nclip = "client"'),
        name="fixed.toml")
    assert run_cli("check", fixed).returncode == 0


def test_dp_with_secure_aggregation_names_every_change_in_one_refusal(tmp_path):
    config = _write(tmp_path, PRIVATE_SECURE.format(
        out=tmp_path / "out", aggregator="fedavg", options="",
        privacy='name = "dp-adaptive"\nnoise_multiplier = 1.0'))
    _assert_clean_error(run_cli("check", config), config,
                        "[privacy] clip = 'coordinator': the coordinator never holds",
                        "; and [privacy] name = 'dp-adaptive': adaptive clipping counts",
                        'Use [privacy] name = "dp-fixed" with clip = "client"')
