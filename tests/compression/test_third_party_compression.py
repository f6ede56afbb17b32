"""A third-party compressor, installed for real, passes the contract suite and runs.

``tests/fixtures/meshkit-signsgd`` is pip-installed (its own pyproject.toml and
entry point) into a temporary directory on PYTHONPATH; nothing in meshkit names it.
Its author's own contract test passes there, ``meshkit plugins`` lists it with
its distribution, and a federated ``meshkit run`` uploads 1 bit a coordinate
with error feedback -- as measured by the transport.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshkit.train import read_metrics

from tests.support.cli import pip_install_target, run_cli
from tests.support.configs import write_config

pytestmark = pytest.mark.slow

PACKAGE = Path(__file__).resolve().parents[1] / "fixtures" / "meshkit-signsgd"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> str:
    target = tmp_path_factory.mktemp("signsgd-site")
    pip_install_target(target, PACKAGE)
    return str(target)


def test_it_is_found_through_its_entry_point_with_its_distribution(site):
    result = run_cli("plugins", pythonpath=site)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if " sign " in f" {line} ")
    assert "compression" in line and "meshkit-signsgd" in line, line


def test_its_authors_contract_test_passes(site, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHKIT_")}
    env["PYTHONPATH"] = site + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(PACKAGE / "check_sign_contract.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert " passed" in result.stdout and "failed" not in result.stdout, result.stdout


def test_a_run_uploads_its_one_bit_payload(site, tmp_path):
    def run(name, tables):
        config = write_config(tmp_path / f"{name}.toml", tmp_path / name, workers=2, rounds=2,
                              extra="clients = 2\n" + tables)
        result = run_cli("run", str(config), pythonpath=site, cwd=str(tmp_path), timeout=180)
        assert result.returncode == 0, result.stdout + result.stderr
        return read_metrics(tmp_path / name)

    whole = run("whole", "")
    signs = run("sign", '\n[compression]\nname = "sign"\n')
    assert [r["round"] for r in signs] == [1, 2]
    assert signs[-1]["accuracy"] > 0.1
    # Its upload carries each key's residual back too (error feedback, float32), so
    # less than the float64 model's partial plus a float32 one, and more than signs alone.
    assert signs[-1]["bytes_up"] < 0.75 * whole[-1]["bytes_up"], (signs[-1], whole[-1])
