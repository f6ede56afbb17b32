"""``meshkit check`` shows each client's examples and labels, and refuses bad partitions."""

from __future__ import annotations

import json

import pytest

from tests.support.cli import run_cli
BASE = """
[run]
task = "{task}"
out = "{out}"

[mesh]
workers = 2

[strategy]
name = "federated"
clients = {clients}
{strategy}

[partitioner]
{partitioner}
"""


def _config(tmp_path, *, partitioner, clients=10, task="digits", strategy="", extra=""):
    path = tmp_path / "run.toml"
    path.write_text(BASE.format(task=task, out=tmp_path / "out", clients=clients,
                                strategy=strategy, partitioner=partitioner) + extra)
    return path


def test_check_prints_label_counts_per_client_for_dirichlet(tmp_path):
    config = _config(tmp_path, partitioner='name = "dirichlet"\nalpha = 0.1')
    result = run_cli("check", str(config))
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("  client ")]
    assert len(lines) == 10
    assert "clients: 10 ([partitioner] dirichlet)" in result.stdout
    assert lines[0].startswith("  client 0: ") and "examples; labels " in lines[0]
    as_json = json.loads(run_cli("check", str(config), "--json").stdout)
    assert sum(c["examples"] for c in as_json["clients"]) == 1797 - 359  # every training row once
    # The same seed, the same split: check twice, the same counts.
    assert run_cli("check", str(config)).stdout == result.stdout


@pytest.mark.parametrize("alpha", ["0", "-0.5"])
def test_alpha_not_above_zero_is_refused_naming_file_table_and_key(tmp_path, alpha):
    config = _config(tmp_path, partitioner=f'name = "dirichlet"\nalpha = {alpha}')
    result = run_cli("check", str(config))
    assert result.returncode == 2
    assert f"{config}: [partitioner]" in result.stderr
    assert "alpha must be greater than 0" in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_partitioner_key_and_name_get_suggestions(tmp_path):
    result = run_cli("check", str(_config(tmp_path, partitioner='name = "dirichlet"\nalfa = 1')))
    assert result.returncode == 2 and "did you mean 'alpha'" in result.stderr
    result = run_cli("check", str(_config(tmp_path, partitioner='name = "dirichelt"')))
    assert result.returncode == 2 and "did you mean 'dirichlet'" in result.stderr


def test_more_clients_than_rows_is_refused(tmp_path):
    config = _config(tmp_path, partitioner='name = "iid"', clients=8, task="synthetic",
                     extra="\n[task]\nrows = 5\nparams = 10\n")
    result = run_cli("check", str(config))
    assert result.returncode == 2
    assert "clients = 8 but the task has only 5 training rows" in result.stderr


def test_evaluate_on_clients_without_held_out_data_is_refused(tmp_path):
    config = _config(tmp_path, partitioner='name = "iid"', clients=2, task="synthetic",
                     strategy='evaluate = "clients"', extra="\n[task]\nparams = 10\n")
    result = run_cli("check", str(config))
    assert result.returncode == 2
    assert "evaluate = 'clients'" in result.stderr and "no test_data()" in result.stderr


def test_a_partitioner_with_a_strategy_that_has_no_clients_is_refused(tmp_path):
    path = tmp_path / "dp.toml"
    path.write_text(f'[run]\nout = "{tmp_path / "o"}"\n[strategy]\nname = "data-parallel"\n'
                    f'[partitioner]\nname = "iid"\n')
    result = run_cli("check", str(path))
    assert result.returncode == 2
    assert "does not split the training set into clients" in result.stderr
