"""The kernel's CLI end to end: a real installed plugin, failures, config errors.

Every test runs ``python -m meshkit`` in a subprocess, as a user would.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from conftest import run_cli

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


def test_an_installed_third_party_plugin_is_listed_with_its_distribution(hello_site):
    result = run_cli("plugins", "--json", pythonpath=hello_site,
                     env={"MESHKIT_DISABLE_PLUGINS": "hello-clash"})
    assert result.returncode == 0, result.stderr
    listing = json.loads(result.stdout)
    rows = {(r["kind"], r["name"]): r for r in listing["components"]}
    scaled = rows[("outer_optimizer", "hello-scaled")]
    assert (scaled["plugin"], scaled["distribution"], scaled["version"]) == (
        "hello", "meshkit-hello", "1.2.3")
    assert rows[("outer_optimizer", "average")]["distribution"] == "meshkit"


def test_an_installed_third_party_component_is_built_through_create(hello_site):
    code = textwrap.dedent("""
        import numpy as np, meshkit.plugins as p
        opt = p.create("outer_optimizer", "hello-scaled", {"factor": 3})
        print(opt.step({}, {"w": np.float64(2.0)})["w"])
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={"PYTHONPATH": hello_site, "MESHKIT_PLUGINS": "hello,outer",
                                 "PATH": "/usr/bin:/bin"}, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "6.0"


def test_a_broken_plugin_is_listed_as_failed_and_the_cli_still_works(hello_site):
    result = run_cli("plugins", pythonpath=hello_site,
                     env={"MESHKIT_DISABLE_PLUGINS": "hello-clash"})
    assert result.returncode == 0, result.stderr
    assert "hello-scaled" in result.stdout
    assert "failed  hello-broken (meshkit-hello 1.2.3): ImportError: the vendor SDK" \
        in result.stdout
    listing = json.loads(run_cli("plugins", "--json", pythonpath=hello_site,
                                 env={"MESHKIT_DISABLE_PLUGINS": "hello-clash"}).stdout)
    failed = {f["plugin"]: f for f in listing["failed"]}
    assert failed["hello-broken"]["distribution"] == "meshkit-hello"


def test_a_misspelled_hook_in_an_installed_plugin_names_the_plugin(hello_site):
    result = run_cli("plugins", "--json", pythonpath=hello_site,
                     env={"MESHKIT_PLUGINS": "hello-typo"})
    assert result.returncode == 0, result.stderr
    (failure,) = json.loads(result.stdout)["failed"]
    assert failure["plugin"] == "hello-typo"
    assert "unknown hook 'meshkit_aggregator'" in failure["error"]
    assert "did you mean 'meshkit_aggregators'" in failure["error"]


def test_a_name_clash_between_installed_plugins_names_both(hello_site):
    # Listed, not fatal: selecting the name is the error (test_cli_broken_plugins.py).
    result = run_cli("plugins", pythonpath=hello_site,
                     env={"MESHKIT_PLUGINS": "outer,hello-clash"})
    assert result.returncode == 0, result.stderr
    for fragment in ("two plugins offer the outer_optimizer 'average'",
                     "plugin 'outer' (meshkit 0.1.0)", "plugin 'hello-clash' (meshkit-hello 1.2.3)"):
        assert fragment in result.stdout, result.stdout


def test_selecting_a_component_of_a_failed_plugin_quotes_its_failure(hello_site, tmp_path):
    config = _write(tmp_path, GOOD_CONFIG.replace('name = "hello-sum"', 'name = "fpga-sum"'))
    result = run_cli("check", config, pythonpath=hello_site,
                     env={"MESHKIT_PLUGINS": "hello,hello-broken"})
    _assert_clean_error(result, "[aggregator] name: no aggregator named 'fpga-sum'",
                        "available: hello-sum",
                        "plugin 'hello-broken' from meshkit-hello 1.2.3 failed to load")


def test_an_empty_allow_list_loads_nothing_and_plugins_still_works():
    result = run_cli("plugins", "--json", env={"MESHKIT_PLUGINS": ""})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"components": [], "failed": [], "conflicts": [],
                                         "plugins": []}
    table = run_cli("plugins", env={"MESHKIT_PLUGINS": ""})
    assert table.returncode == 0 and "no components" in table.stdout


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


def test_version_and_help():
    assert run_cli("--version").stdout.strip() == "meshkit, version 0.1.0"
    help_text = run_cli("--help").stdout
    assert "plugins" in help_text and "check" in help_text


@pytest.mark.parametrize("args", [["--help"], ["plugins"], ["plugins", "--json"]])
def test_help_and_plugins_import_no_heavy_code(args):
    """Listing must stay fast everywhere: no plugin may import numpy (or torch) to list."""
    code = textwrap.dedent(f"""
        import sys
        from meshkit.cli import main
        try:
            main({args!r}, standalone_mode=False)
        finally:
            heavy = sorted(m for m in ("numpy", "torch", "ml_dtypes") if m in sys.modules)
            print("HEAVY:" + ",".join(heavy), file=sys.stderr)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert "HEAVY:\n" in result.stderr or result.stderr.rstrip().endswith("HEAVY:"), result.stderr


def test_a_plugin_offering_only_event_hooks_is_listed_as_an_observer(hello_site, tmp_path):
    observer = tmp_path / "observer_only.py"
    observer.write_text(textwrap.dedent("""
        import meshkit

        @meshkit.hookimpl
        def meshkit_round_completed(report):
            pass
    """))
    code = textwrap.dedent("""
        import json, sys, meshkit.plugins as p
        from meshkit.cli import main
        import observer_only
        p.reset(p.build_manager({"observer-only": observer_only}, entry_points=False))
        main(sys.argv[1:], standalone_mode=False)
    """)
    for args, expected in ((["plugins"], "observer  observer-only: meshkit_round_completed"),
                           (["plugins", "--json"], '"hooks": [\n        "meshkit_round_completed"')):
        result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                                text=True, cwd=tmp_path, timeout=60,
                                env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
        assert result.returncode == 0, result.stderr
        assert expected in result.stdout
