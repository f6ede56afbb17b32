"""``fedbuff`` on a population task (issue 35, item 2): clients made from their number.

Before, ``FedBuff.clients()`` took no task, so ``check`` and ``run`` crashed
with a ``TypeError`` on ``synthetic-federated``, and its refusals counted one
client per worker ("only 2 clients" for a 100,000-client population); and the
next client was drawn from a list of every free client, O(N) per dispatch.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from meshkit_strategies.fedbuff import nth_free

from tests.support.cli import run_cli

POPULATION = """
[run]
task = "synthetic-federated"
out = "{out}"

[mesh]
workers = 2

[strategy]
name = "fedbuff"
rounds = {rounds}
buffer_size = {buffer_size}
concurrency = 8

[simulation]
clock = "virtual"

[task]
clients = {clients}
dim = 5
classes = 3
hidden = 0
"""


def _config(tmp_path: Path, *, clients: int, rounds: int = 3, buffer_size: int = 4) -> str:
    path = tmp_path / "population.toml"
    path.write_text(POPULATION.format(out=tmp_path / "run", clients=clients, rounds=rounds,
                                      buffer_size=buffer_size))
    return str(path)


def test_check_counts_a_populations_clients_not_its_workers(tmp_path):
    result = run_cli("check", _config(tmp_path, clients=100_000))
    assert result.returncode == 0, result.stderr
    assert "clients: 100000 (the task's population)" in result.stdout


def test_a_buffer_larger_than_the_population_is_refused_with_its_real_size(tmp_path):
    result = run_cli("check", _config(tmp_path, clients=3, buffer_size=4))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert f"{tmp_path / 'population.toml'}: [strategy] buffer_size = 4, but there are only " \
           f"3 clients" in result.stderr


def test_the_next_client_is_drawn_exactly_as_from_the_list_of_free_clients():
    rng = random.Random(35)
    for _ in range(2000):
        clients = rng.randint(1, 40)
        busy = sorted(rng.sample(range(clients), rng.randint(0, clients - 1)))
        free = [c for c in range(clients) if c not in busy]
        index = rng.randrange(len(free))
        assert nth_free(index, busy) == free[index]


@pytest.mark.slow
def test_fedbuff_runs_200_server_steps_over_100000_clients_on_the_virtual_clock(tmp_path):
    result = run_cli("run", _config(tmp_path, clients=100_000, rounds=200), "-q",
                     timeout=300)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    assert [row["round"] for row in rows] == list(range(1, 201))
    served = {int(c) for row in rows for c in row["served"]}
    assert len(served) > 100 and max(served) >= 50_000  # drawn from the whole population
    assert rows[-1]["simulated_time"] > rows[0]["simulated_time"]
