"""``[run] client_metrics = "file"``: per-client figures streamed to clients.jsonl (_artifacts)."""

from __future__ import annotations

import json


def test_per_client_figures_leave_the_row_as_one_line_per_client():
    from meshkit.train._coordinator.artifacts import split_clients

    row = {"round": 4, "clients": [3, 9], "served": {"3": 1, "9": 2},
           "client_examples": {"3": 10, "9": 5},
           "client_metrics": {"9": {"accuracy": 0.5, "examples": 2.0}}, "loss": 1.0}
    slim, lines = split_clients(row)
    assert slim == {"round": 4, "clients": [3, 9], "loss": 1.0}
    assert lines == [{"round": 4, "client": 3, "rank": 1, "examples": 10},
                     {"round": 4, "client": 9, "rank": 2, "examples": 2.0, "accuracy": 0.5}]


def test_a_resume_keeps_only_the_client_lines_its_checkpoint_covers(tmp_path):
    from meshkit.train._coordinator.artifacts import CLIENTS_NAME, append_clients, truncate_metrics

    for rnd in (1, 2, 3):
        append_clients(tmp_path, [{"round": rnd, "client": c} for c in range(3)])
    with open(tmp_path / CLIENTS_NAME, "a") as fh:
        fh.write('{"round": 4, "cli')  # torn by a crash
    truncate_metrics(tmp_path, 2)
    rounds = [json.loads(line)["round"] for line in (tmp_path / CLIENTS_NAME).read_text().splitlines()]
    assert rounds == [1, 1, 1, 2, 2, 2]
