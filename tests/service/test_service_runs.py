"""``meshkit serve`` with real nodes: runs share them, finish, list, stop, and stay private."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshkit import wire
from meshkit.checkpoint import load_checkpoint
from tests.support.cli import run_cli
from tests.support.service import Federation, run_toml


def _cli(fed: Federation, *args: str) -> dict:
    result = run_cli(*args, "--service", str(fed.state), "--json", cwd=str(fed.root))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.slow
def test_three_runs_share_four_nodes_finish_and_one_stops_with_its_checkpoint(
        federation: Federation) -> None:
    fed = federation
    fed.start_service()
    nodes = [fed.start_node(f"n{i}") for i in range(4)]
    configs = [run_toml(fed.root / "two.toml", workers=2, rounds=3, seed=1),
               run_toml(fed.root / "one.toml", workers=1, rounds=3, seed=2),
               run_toml(fed.root / "long.toml", workers=1, rounds=10_000, seed=3)]
    ids = [_cli(fed, "submit", str(c))["id"] for c in configs]
    assert ids == ["r1", "r2", "r3"]

    fed.wait_round("r3", 1)
    stopped = _cli(fed, "stop", "r3")
    assert stopped["state"] in ("stopping", "stopped")
    finals = {run: fed.wait_run(run) for run in ids}

    assert finals["r1"]["state"] == "finished" and finals["r1"]["rounds_completed"] == 3
    assert finals["r2"]["state"] == "finished" and finals["r2"]["rounds_completed"] == 3
    assert finals["r3"]["state"] == "stopped", finals["r3"]
    kept = load_checkpoint(fed.state / "runs" / "r3" / "out")
    assert 1 <= kept.round == finals["r3"]["rounds_completed"] < 10_000

    listed = _cli(fed, "ls")["runs"]
    assert [(r["id"], r["name"], r["state"]) for r in listed] == [
        ("r1", "two.toml", "finished"), ("r2", "one.toml", "finished"),
        ("r3", "long.toml", "stopped")]
    status = _cli(fed, "status", "r1")
    assert status["latest"]["round"] == 3 and "accuracy" in status["latest"]["metrics"]
    # The three ran at once: four nodes, four ranks, each node served one run.
    served = sorted(e["run"] for n in nodes for e in n.events("run"))
    assert served == ["r1", "r1", "r2", "r3"]
    logs = run_cli("logs", "r1", "--service", str(fed.state), cwd=str(fed.root))
    assert logs.returncode == 0 and "finished: finished after 3 round(s)" in logs.stdout


@pytest.mark.slow
def test_a_node_not_in_a_runs_authorized_nodes_never_receives_that_run(
        federation: Federation) -> None:
    fed = federation
    fed.start_service()
    (fed.root / "only_a").write_text(fed.key("a") + "\n")
    alice = fed.start_node("a")
    bob = fed.start_node("b")
    private = [run_toml(fed.root / f"private{i}.toml", workers=1, rounds=2, seed=i,
                        authorized="only_a") for i in (1, 2)]
    anyone = run_toml(fed.root / "open.toml", workers=1, rounds=2, seed=5)
    ids = [_cli(fed, "submit", str(c))["id"] for c in (*private, anyone)]
    finals = {run: fed.wait_run(run) for run in ids}
    assert all(f["state"] == "finished" for f in finals.values()), finals

    # Both private runs went to a (the second waited for it, although b was
    # idle); b was never sent a private one. The open run went to whichever
    # node was free first: which one is the scheduler's timing, not the rule.
    served_by_a = {e["run"] for e in alice.events("run")}
    served_by_b = [e["run"] for e in bob.events("run")]
    assert {"r1", "r2"} <= served_by_a
    assert not {"r1", "r2"} & set(served_by_b), served_by_b
    assert sorted([*served_by_a, *served_by_b]) == ["r1", "r2", "r3"]
    started = [e for e in fed.client().events("r2")["events"] if e["kind"] == "started"]
    assert list(started[0]["data"]["ranks"]) == [wire_id(fed.root / "a.key.pub")]


def wire_id(pub: Path) -> str:
    return wire.fingerprint(wire.parse_public_key(pub.read_text().strip()))
