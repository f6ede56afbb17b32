"""``meshkit plugins`` end to end: a real installed plugin, failures, observers.

Every listing runs ``python -m meshkit`` in a subprocess, as a user would.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.support.cli import run_cli
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
                     "plugin 'outer' (meshkit 0.1.0)",
                     "plugin 'hello-clash' (meshkit-hello 1.2.3)"):
        assert fragment in result.stdout, result.stdout


def test_an_empty_allow_list_loads_nothing_and_plugins_still_works():
    result = run_cli("plugins", "--json", env={"MESHKIT_PLUGINS": ""})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"components": [], "failed": [], "conflicts": [],
                                         "plugins": []}
    table = run_cli("plugins", env={"MESHKIT_PLUGINS": ""})
    assert table.returncode == 0 and "no components" in table.stdout


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
