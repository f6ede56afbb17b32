"""``benchmarks/robustness.py`` made for your own model (``--config``), and ``--plot``'s check
before any run (issue 35, item 4)."""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _benchmark():
    spec = importlib.util.spec_from_file_location("robustness_benchmark",
                                                  ROOT / "benchmarks" / "robustness.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _config(tmp_path: Path) -> str:
    path = tmp_path / "mine.toml"
    path.write_text(textwrap.dedent(f"""
        [run]
        task = "digits"
        seed = 5
        out = "{tmp_path / 'out'}"

        [task]
        hidden = 8

        [mesh]
        workers = 2

        [strategy]
        name = "federated"
        rounds = 2
        clients = 10

        [partitioner]
        name = "iid"

        [attack]
        name = "sign-flip"
        clients = [1, 4, 7]
    """))
    return str(path)


@pytest.mark.slow
def test_the_matrix_runs_on_a_configs_task_split_clients_rounds_and_attackers(tmp_path, capsys):
    bench = _benchmark()
    config = _config(tmp_path)
    assert bench.main(["--config", config, "--rules", "fedavg", "krum", "--attacks", "none",
                       "sign-flip", "--json"]) == 0
    cells = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(c["rule"], c["attack"]) for c in cells] == [
        ("fedavg", "none"), ("fedavg", "sign-flip"), ("krum", "none"), ("krum", "sign-flip")]
    for cell in cells:
        assert cell["task"] == f"digits ({config})" and cell["error"] is None
        assert cell["rounds"] == 2 and cell["seed"] == 5  # the config's, not the matrix's 30/0
        assert 0.0 <= cell["accuracy"] <= 1.0
    # Its 3 attackers of 10 clients, so krum is told f = 3 and 3 clients attack.
    setup = bench.Setup(config)
    assert (setup.clients, setup.attackers) == (10, 3)
    assert setup.rule_options("krum") == {"f": 3}
    assert len(cells[1]["attacked"]) == 3


def test_a_bad_config_exits_2_naming_it(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('[run]\ntask = "digits"\n[strategy]\nrunds = 2\n')
    with pytest.raises(SystemExit) as info:
        _benchmark().main(["--config", str(bad)])
    assert info.value.code == 2
    assert "[strategy] runds: unknown key" in capsys.readouterr().err


def test_plot_without_matplotlib_is_refused_before_any_run(tmp_path, monkeypatch, capsys):
    bench = _benchmark()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError

    def no_run(*args, **kwargs):
        raise AssertionError("a cell ran before --plot was checked")

    monkeypatch.setattr(bench, "run_cell", no_run)
    with pytest.raises(SystemExit) as info:
        bench.main(["--rules", "fedavg", "--attacks", "none", "--plot",
                    str(tmp_path / "p.png")])
    assert info.value.code == 2
    assert "pip install 'meshkit[plot]'" in capsys.readouterr().err
