"""A real-process run with one ``meshkit node --attack sign-flip`` among four honest nodes.

Five ``meshkit node`` processes serve a coordinator over TCP on loopback;
rank 5 was started with ``--attack sign-flip --attack-option factor=10``:
it sends ``-10`` times its update. Setup chosen so the result is
unambiguous: 5 clients (one per node), so the plain mean moves the model by
``(4 - 10) / 5 = -1.2`` times an honest update each round -- uphill --
while the coordinate-wise median of five is an honest value whatever one
contributor sends. ``fedavg`` diverges (accuracy falls towards chance,
loss rises above the initial model's); ``median`` converges. Every fit the
attacker served is named in ``metrics.jsonl`` (``attacked``).
"""

from __future__ import annotations

import json

import pytest

from tests.support.cli import run_cli
from tests.support.configs import external_config
from tests.support.nodes import run_with_nodes, spawn_node

pytestmark = pytest.mark.slow

SECRET = b"attack-test-secret-0123456789"
ROUNDS = 6
NODES = 5
ATTACKER = 5


def _run(tmp_path, aggregator: str) -> list[dict]:
    config = external_config(tmp_path, workers=NODES, rounds=ROUNDS, secret=SECRET,
                             extra=f'\n[aggregator]\nname = "{aggregator}"\n')

    def start(address: str):
        return [spawn_node(r, NODES + 1, address, tmp_path / "secret",
                           *(("--attack", "sign-flip", "--attack-option", "factor=10")
                             if r == ATTACKER else ()))
                for r in range(1, NODES + 1)]

    run_with_nodes(config, start)
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _attacked_fits_are_recorded(rows: list[dict]) -> None:
    for row in rows:
        by_attacker = sorted(int(c) for c, rank in row["served"].items() if rank == ATTACKER)
        assert by_attacker and row["attacked"] == by_attacker, row


def test_fedavg_diverges_under_one_sign_flipping_node(tmp_path):
    rows = _run(tmp_path, "fedavg")
    _attacked_fits_are_recorded(rows)
    assert rows[-1]["accuracy"] < 0.3, [r["accuracy"] for r in rows]
    assert rows[-1]["loss"] > rows[0]["loss"], [r["loss"] for r in rows]


def test_median_converges_under_the_same_node(tmp_path):
    rows = _run(tmp_path, "median")
    _attacked_fits_are_recorded(rows)
    assert rows[-1]["accuracy"] > 0.6, [r["accuracy"] for r in rows]
    assert rows[-1]["loss"] < rows[0]["loss"], [r["loss"] for r in rows]


def test_a_node_refuses_an_omniscient_attack_before_joining():
    result = run_cli("node", "--rank", "1", "--world", "2", "--peers", "127.0.0.1:1",
                     "--attack", "alie")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "alie is omniscient" in result.stderr
    assert "[attack] name = \"alie\"" in result.stderr


def test_a_misspelt_attack_option_is_refused_naming_the_flag():
    result = run_cli("node", "--rank", "1", "--world", "2", "--peers", "127.0.0.1:1",
                     "--attack", "scale", "--attack-option", "factr=3")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "factr" in result.stderr
