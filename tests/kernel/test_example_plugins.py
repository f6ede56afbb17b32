"""The example third-party plugins, installed for real and used the way a user would.

All three packages under examples/plugins/ are pip-installed (no deps, no
build isolation: hatchling comes from the test environment) into one
temporary directory put on PYTHONPATH, so the test leaves nothing behind in
the environment. Then, in subprocesses, as a user would: ``meshkit plugins``
lists them with their distribution and version, a config selects them,
``meshkit run`` trains with them, and each package's own tests (meshkit's
contract suites) pass against the installed copy.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.cli import pip_install_target, run_cli
from tests.support.guide import extract_guide_files
ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "plugins"
PACKAGES = ("meshkit-robust", "meshkit-int8board", "meshkit-csvlog")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> str:
    target = tmp_path_factory.mktemp("example-plugins-site")
    pip_install_target(target, *(EXAMPLES / p for p in PACKAGES))
    return str(target)


def _config(tmp_path: Path, aggregator: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(textwrap.dedent(f"""
        [run]
        task = "digits"
        seed = 0
        out = "{tmp_path / 'out'}"

        [mesh]
        transport = "tcp"
        launch = "local"
        workers = 2

        [strategy]
        name = "federated"
        rounds = 2

        [aggregator]
        {aggregator}
    """))
    return str(path)


def test_meshkit_plugins_lists_the_examples_with_distribution_and_version(site):
    result = run_cli("plugins", "--json", pythonpath=site)
    assert result.returncode == 0, result.stderr
    listing = json.loads(result.stdout)
    rows = {(r["kind"], r["name"]): r for r in listing["components"]}
    expected = {
        ("aggregator", "bucketing"): ("robust", "meshkit-robust", "0.2.0"),
        # Built-in names now: the example no longer offers them, so nothing collides.
        ("aggregator", "median"): ("aggregators", "meshkit", rows[("aggregator", "median")]
                                   ["version"]),
        ("board", "int8"): ("int8board", "meshkit-int8board", "0.1.0"),
    }
    for key, provenance in expected.items():
        row = rows[key]
        assert (row["plugin"], row["distribution"], row["version"]) == provenance, row
    assert listing["failed"] == [], listing["failed"]

    table = run_cli("plugins", pythonpath=site).stdout
    assert listing.get("conflicts", []) == [], listing.get("conflicts")
    assert any("bucketing" in line and "meshkit-robust" in line and "0.2.0" in line
               for line in table.splitlines()), table


def test_a_config_selects_the_robust_aggregator_and_meshkit_check_shows_it(site, tmp_path):
    result = run_cli("check", _config(tmp_path, 'name = "bucketing"\nbucket_size = 3'),
                     pythonpath=site)
    assert result.returncode == 0, result.stderr
    assert "aggregator: bucketing from plugin 'robust' (meshkit-robust 0.2.0)" in result.stdout
    assert "bucket_size=3" in result.stdout


def test_a_bad_option_of_an_installed_plugin_is_a_clean_config_error(site, tmp_path):
    result = run_cli("check", _config(tmp_path, 'name = "bucketing"\nbucket_size = 0'),
                     pythonpath=site)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "[aggregator]" in result.stderr and "bucket_size must be an integer >= 1" in result.stderr


def test_meshkit_run_trains_with_bucketing_and_the_csv_observer_records_it(site, tmp_path):
    result = run_cli("run", _config(tmp_path, 'name = "bucketing"'), pythonpath=site,
                     timeout=120)
    assert result.returncode == 0, result.stderr
    assert "round   2/2" in result.stdout and "done: federated, 2 round(s)" in result.stdout

    with open(tmp_path / "out" / "rounds.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["round"] for r in rows] == ["1", "2"]
    assert rows[0]["strategy"] == "federated" and "accuracy" in rows[0]


def test_the_installed_int8_board_runs_through_the_kernels_deadline_wrapper(site):
    code = textwrap.dedent("""
        import numpy as np
        from meshkit.node.board import open_board
        with open_board("int8", {"stage_id": "mlp.0", "input_elems": 16,
                                 "output_elems": 4, "scale": 0.05}) as board:
            y = board.execute(np.linspace(-1, 1, 16, dtype=np.float32))
            print(board.descriptor.dtype, y.dtype, y.shape)
            try:
                board.execute(np.zeros(15, np.float32))
            except Exception as exc:
                print(type(exc).__name__, exc)
    """)
    env = {**os.environ, "PYTHONPATH": site}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "int8 float32 (4,)"
    assert lines[1].startswith("BoardError int8 board for stage [mlp.0]: expected an "
                               "activation of 16 values")


@pytest.mark.parametrize("package", PACKAGES)
def test_each_example_passes_its_own_tests_when_installed(site, package):
    # `-o pythonpath=` drops the package's own `pythonpath = ["src"]`, so its
    # tests import the installed copy, as they would in the package's CI.
    env = {k: v for k, v in os.environ.items()
           if k not in ("MESHKIT_PLUGINS", "MESHKIT_DISABLE_PLUGINS")}
    env["PYTHONPATH"] = site
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "pythonpath=",
         "--rootdir", str(EXAMPLES / package), "-c", str(EXAMPLES / package / "pyproject.toml"),
         str(EXAMPLES / package / "tests")],
        capture_output=True, text=True, env=env, cwd=str(EXAMPLES / package), timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout
    assert "failed" not in result.stdout


# -- the plugin author guide, extracted and run -----------------------------------

GUIDE = ROOT / "docs" / "writing-a-plugin.md"


@pytest.fixture(scope="module")
def guide_project(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    work = tmp_path_factory.mktemp("guide")
    files = extract_guide_files(GUIDE, work)
    names = sorted(str(p.relative_to(work)) for p in files)
    assert names == [
        "job.toml",
        "meshkit-median/meshkit_median.py",
        "meshkit-median/pyproject.toml",
        "meshkit-median/test_median.py",
        "meshkit-midrange/README.md",
        "meshkit-midrange/pyproject.toml",
        "meshkit-midrange/src/meshkit_midrange/__init__.py",
        "meshkit-midrange/src/meshkit_midrange/midrange.py",
        "meshkit-midrange/tests/test_midrange.py",
    ], names
    site = work / "site"
    pip_install_target(site, work / "meshkit-median", work / "meshkit-midrange")
    return {"work": str(work), "site": str(site)}


def _run_pytest(tests: Path, site: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MESHKIT_PLUGINS", "MESHKIT_DISABLE_PLUGINS")}
    env["PYTHONPATH"] = site
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
         str(tests), str(tests)],
        capture_output=True, text=True, env=env, cwd=str(tests), timeout=120)


def test_the_guides_short_path_is_a_few_dozen_lines(guide_project):
    package = Path(guide_project["work"]) / "meshkit-median"
    lines = sum(len(f.read_text().splitlines()) for f in package.iterdir() if f.is_file())
    assert lines <= 80, f"the short path grew to {lines} lines"
    text = GUIDE.read_text()
    assert text.index("## The short path") < text.index("## 1. The package")


def test_the_guides_short_path_installs_is_listed_and_passes_its_contract(guide_project):
    result = run_cli("plugins", "--json", pythonpath=guide_project["site"])
    assert result.returncode == 0, result.stderr
    rows = {(r["kind"], r["name"]): r for r in json.loads(result.stdout)["components"]}
    row = rows[("aggregator", "simple-median")]
    assert (row["plugin"], row["distribution"], row["version"]) == (
        "median", "meshkit-median", "0.1.0")
    tested = _run_pytest(Path(guide_project["work"]) / "meshkit-median", guide_project["site"])
    assert tested.returncode == 0, tested.stdout[-3000:] + tested.stderr[-2000:]
    assert "failed" not in tested.stdout and " passed" in tested.stdout


def test_the_guides_plugin_installs_and_is_listed(guide_project):
    result = run_cli("plugins", "--json", pythonpath=guide_project["site"])
    assert result.returncode == 0, result.stderr
    rows = {(r["kind"], r["name"]): r for r in json.loads(result.stdout)["components"]}
    row = rows[("aggregator", "midrange")]
    assert (row["plugin"], row["distribution"], row["version"]) == (
        "midrange", "meshkit-midrange", "0.1.0")


def test_the_guides_plugin_passes_its_contract_suite(guide_project):
    result = _run_pytest(Path(guide_project["work"]) / "meshkit-midrange" / "tests",
                         guide_project["site"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "failed" not in result.stdout and " passed" in result.stdout


def test_the_guides_config_selects_the_plugin_and_runs(guide_project):
    work = guide_project["work"]
    check = run_cli("check", "job.toml", pythonpath=guide_project["site"], cwd=work)
    assert check.returncode == 0, check.stderr
    assert ("aggregator: midrange from plugin 'midrange' (meshkit-midrange 0.1.0) "
            "[allow_nonfinite=False]") in check.stdout

    run = run_cli("run", "job.toml", pythonpath=guide_project["site"], cwd=work, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "done: federated, 2 round(s)" in run.stdout
    assert (Path(work) / "runs" / "midrange" / "metrics.jsonl").exists()


def test_the_guides_failure_table_quotes_real_messages(guide_project, tmp_path):
    # The guide promises these exact phrasings; check them against meshkit.
    text = GUIDE.read_text()
    config = Path(guide_project["work"]) / "job.toml"
    bad = tmp_path / "job.toml"
    bad.write_text(config.read_text().replace("allow_nonfinite = false",
                                              "allow_nonfinit = false"))
    result = run_cli("check", str(bad), pythonpath=guide_project["site"])
    assert result.returncode == 2
    message = "[aggregator] allow_nonfinit: unknown key (did you mean 'allow_nonfinite'?)"
    assert message in result.stderr
    assert f"`job.toml: {message}`" in text

    bad.write_text(config.read_text().replace("allow_nonfinite = false",
                                              'allow_nonfinite = "no"'))
    result = run_cli("check", str(bad), pythonpath=guide_project["site"])
    assert "[aggregator] allow_nonfinite: expected true or false, got 'no'" in result.stderr


def _model_parallel_config(tmp_path: Path, board: str, options: str) -> str:
    path = tmp_path / f"{board}.toml"
    path.write_text(textwrap.dedent(f"""
        [run]
        task = "digits"
        seed = 0
        out = "{tmp_path / board}"

        [mesh]
        launch = "local"
        workers = 2

        [strategy]
        name = "model-parallel"
        batch_size = 256

        [[strategy.boards]]
        board = "{board}"
        options = {options}

        [[strategy.partitions]]
        nodes = ["hidden"]
        rank = 1

        [[strategy.partitions]]
        nodes = ["output"]
        rank = 2

        [[strategy.partitions]]
        nodes = ["scale"]
        tag = "scale"
    """))
    return str(path)


def test_meshkit_run_serves_a_stage_on_the_int8_board(site, tmp_path):
    # The digits task's first stage is x / 16 on pixel values 0..16. On the
    # int8 board it is the identity matrix with weight_scale = 1/16 (and an
    # input scale of 1/4, so 16 quantizes to 64, inside int8): exact for those
    # inputs, so the pipeline must score exactly what the loopback board does.
    import numpy as np

    np.save(tmp_path / "eye64.npy", np.eye(64, dtype=np.int8))
    int8 = run_cli("run", _model_parallel_config(
        tmp_path, "int8", f'{{ stage_id = "scale", input_elems = 64, output_elems = 64, '
                          f'scale = 0.25, weight_scale = 0.0625, '
                          f'weights = "{tmp_path / "eye64.npy"}" }}'),
        pythonpath=site, timeout=120)
    assert int8.returncode == 0, int8.stderr
    assert "rank 3 joined (fixed_function" in int8.stdout + int8.stderr

    loopback = run_cli("run", _model_parallel_config(
        tmp_path, "loopback", '{ stage_id = "scale", input_elems = 64, output_elems = 64, '
                              'function = "scale", scale = 0.0625 }'),
        pythonpath=site, timeout=120)
    assert loopback.returncode == 0, loopback.stderr

    def metrics(out: str) -> dict:
        with open(tmp_path / out / "metrics.jsonl") as fh:
            return json.loads(fh.readlines()[-1])

    assert metrics("int8")["accuracy"] == metrics("loopback")["accuracy"]
    assert metrics("int8")["loss"] == pytest.approx(metrics("loopback")["loss"], rel=1e-6)
