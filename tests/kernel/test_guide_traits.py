"""docs/writing-a-plugin.md §9.1, run as written: a third-party linear aggregator under secure aggregation.

The guide's ``# example file: PATH`` blocks are written out, the package is
pip-installed through its entry point into a temporary directory on
PYTHONPATH, and ``meshkit run`` plays the guide's ``secure-job.toml``; the
model equals the same job with ``fedavg``, bit for bit. With the ``traits``
line removed, ``meshkit check`` refuses in the words the guide quotes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshkit.checkpoint import load_checkpoint

from tests.support.cli import pip_install_target, run_cli
from tests.support.guide import extract_guide_files

pytestmark = pytest.mark.slow

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "writing-a-plugin.md"


def _extract(into: Path) -> list[str]:
    files = extract_guide_files(GUIDE, into, marker="# example file:")
    return sorted(str(p.relative_to(into)) for p in files)


@pytest.fixture(scope="module")
def guide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("guide-traits")
    assert _extract(work) == ["meshkit-workmean/meshkit_workmean.py",
                              "meshkit-workmean/pyproject.toml", "secure-job.toml"]
    return work


def test_the_guides_linear_aggregator_runs_under_secure_aggregation_as_fedavg_does(guide,
                                                                                   tmp_path):
    site = tmp_path / "site"
    pip_install_target(site, guide / "meshkit-workmean")
    job = (guide / "secure-job.toml").read_text()
    (tmp_path / "secure-job.toml").write_text(job)
    (tmp_path / "fedavg.toml").write_text(
        job.replace('name = "work-mean"', 'name = "fedavg"').replace("runs/work-mean",
                                                                     "runs/fedavg"))
    for config in ("secure-job.toml", "fedavg.toml"):
        result = run_cli("run", config, pythonpath=str(site), cwd=str(tmp_path), timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
    theirs = load_checkpoint(tmp_path / "runs" / "work-mean")
    fedavg = load_checkpoint(tmp_path / "runs" / "fedavg")
    assert theirs.round == fedavg.round == 2
    for key, value in fedavg.state.items():
        assert theirs.state[key].tobytes() == value.tobytes(), key


def test_without_its_traits_line_the_guides_aggregator_is_refused_as_the_guide_says(guide,
                                                                                   tmp_path):
    package = tmp_path / "meshkit-workmean"
    package.mkdir()
    (package / "pyproject.toml").write_text((guide / "meshkit-workmean" / "pyproject.toml")
                                            .read_text())
    source = (guide / "meshkit-workmean" / "meshkit_workmean.py").read_text()
    assert "    traits = meshkit.AggregatorTraits(" in source
    (package / "meshkit_workmean.py").write_text(
        "\n".join(line for line in source.splitlines()
                  if not line.startswith("    traits = ")) + "\n")
    site = tmp_path / "site"
    pip_install_target(site, package)
    (tmp_path / "secure-job.toml").write_text((guide / "secure-job.toml").read_text())
    result = run_cli("check", "secure-job.toml", pythonpath=str(site), cwd=str(tmp_path))
    assert result.returncode == 2, result.stdout + result.stderr
    said = " ".join(result.stderr.split())
    quoted = GUIDE.read_text().split("refuses, exit status 2:\n\n```\n", 1)[1].split("```")[0]
    for piece in " ".join(quoted.split()).split("(...)"):
        assert piece.strip() in said, (piece, said)
