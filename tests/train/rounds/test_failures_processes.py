"""One hostile rank among five real ``meshkit node`` processes: every round finishes.

The hostile node runs :mod:`tests.support.hostile_task` with its own
``--task-option misbehave=...`` (a different breach each round); the other
four are honest. Every round completes, the hostile rank is named with its
reason in the round's ``failed`` (and ``summary.json``), and because a fit
is a pure function of (model, client, seed) the clients it failed are served
again by the honest ranks: the final model equals, bit for bit, a run on four
honest nodes alone.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.configs import write_secret_file
from tests.support.nodes import finish, spawn_node

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
SECRET = b"hostile-rank-secret-0123456789abcdef"
HOSTILE = 5  # the last of five workers


def config(tmp_path: Path, name: str, *, workers: int, clients: int, rounds: int,
           aggregator: str = "fedavg") -> Path:
    secret = write_secret_file(tmp_path / "secret", SECRET)
    path = tmp_path / f"{name}.toml"
    path.write_text(f"""
[run]
task = "tests.support.hostile_task:Hostile"
seed = 3
out = "{tmp_path / name}"

[mesh]
launch = "external"
workers = {workers}
bind = "127.0.0.1:0"
secret_file = "{secret}"
timeout = 4
join_timeout = 60

[strategy]
name = "federated"
rounds = {rounds}
clients = {clients}

[aggregator]
name = "{aggregator}"
""")
    return path


def run(path: Path, workers: int, hostile: str = "") -> Any:
    """Run ``path`` here over ``workers`` node processes; the last misbehaves as ``hostile``."""
    from meshkit.train import Runner

    listening: list[str] = []
    ready = threading.Event()
    outcome: dict[str, Any] = {}

    def progress(event: Any) -> None:
        if event.kind == "listening":
            listening.append(event.message.split()[3])
            ready.set()

    def drive() -> None:
        try:
            outcome["report"] = Runner(str(path), progress=progress).run()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            outcome["error"] = exc
        ready.set()

    coordinator = threading.Thread(target=drive, daemon=True)
    coordinator.start()
    assert ready.wait(60) and listening, outcome.get("error")
    procs = []
    for rank in range(1, workers + 1):
        extra = ["--task-option", f"misbehave={hostile}"] if hostile and rank == workers else []
        procs.append(spawn_node(rank, workers + 1, listening[0], path.parent / "secret", *extra))
    try:
        coordinator.join(240)
        assert not coordinator.is_alive(), "the run did not finish"
        for rank, proc in enumerate(procs, 1):
            if hostile and rank == workers:
                continue  # dropped, quarantined or stalled: its exit is not the point
            _, err = finish(proc, 60)
            assert proc.returncode == 0, err
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                finish(proc, 10)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["report"]


@pytest.fixture(autouse=True)
def _importable(monkeypatch):
    # The nodes import the hostile task by module reference, as a user's would.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))


def rows(report: Any) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (Path(report.out) / "metrics.jsonl").read_text()
            .splitlines()]


def same_model(a: Any, b: Any) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert np.asarray(a[key]).tobytes() == np.asarray(b[key]).tobytes(), key


@pytest.fixture(scope="module")
def honest_runs(tmp_path_factory):
    """clients -> the run of four honest nodes (each computed once for the module)."""
    done: dict[int, Any] = {}

    def honest(clients: int) -> Any:
        if clients not in done:
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("PYTHONPATH", os.pathsep.join(
                    [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
                where = tmp_path_factory.mktemp(f"honest{clients}")
                done[clients] = run(config(where, "honest", workers=4, clients=clients,
                                           rounds=4), 4)
        return done[clients]
    return honest


@pytest.mark.parametrize("clients, modes, why", [
    # One client a worker: the flat engine, each contribution checked at the boundary.
    (5, "nan+scalar+shape", ["holds NaN or inf", "is an array float64[]",
                             "is an array float64[65, 32]"]),
    (5, "error+inf+hang", ["hostile node: this fit refuses", "holds NaN or inf", None]),
    # Two a worker: the batched round (each worker folds its own clients exactly).
    (10, "error+inf+hang", ["hostile node: this fit refuses", "sent NaN or inf", None]),
    (10, "nan+scalar+shape", ["NaN or inf", "float64[]", "float64[65, 32]"]),
    # 1e308 is finite, but no worker's exact (fixed-point) sum holds it: out of range.
    (10, "huge+huge+huge", ["beyond the range of a 32-bit fixed-point sum"] * 3),
    # Nor does the flat round's strict mean (beyond 1.34e154, the square root of float64's
    # largest value): its fold sees it, the round is replayed and the sender dropped.
    (5, "huge+huge+huge", ["is out of range: it holds 1e+308"] * 3),
], ids=["flat", "flat-error-inf-hang", "batched", "batched-nan-scalar-shape", "batched-huge",
        "flat-huge"])
def test_one_hostile_rank_among_five_costs_only_its_own_rank(tmp_path, honest_runs, clients,
                                                             modes, why):
    honest = honest_runs(clients)
    hostile = run(config(tmp_path, "hostile", workers=5, clients=clients, rounds=4), 5, modes)
    assert hostile.ok and hostile.rounds_completed == 4, hostile.error
    lines = rows(hostile)
    assert [line["round"] for line in lines] == [1, 2, 3, 4]
    for line in lines:
        # Every client of every round was served, by an honest rank.
        assert line["not_served"] == {} and sorted(map(int, line["served"])) == \
            list(range(clients)), line
    for line, expected in zip(lines, why):
        if expected is None:  # the hang: the pool's deadline declares it dead
            assert line["failed"] == {} and line["dropped"] == [HOSTILE], line
        else:
            assert list(line["failed"]) == [str(HOSTILE)] and expected in \
                line["failed"][str(HOSTILE)], line
    summary = json.loads((Path(hostile.out) / "summary.json").read_text())
    assert summary["ok"] is True
    if modes.endswith("hang"):
        assert "no reply" in summary["dropped"][str(HOSTILE)] or \
            "stall" in summary["dropped"][str(HOSTILE)], summary["dropped"]
        assert len(summary["failed"][str(HOSTILE)]) == 2
    else:
        # Failing in three rounds is quarantine: it sits out the fourth.
        assert summary["dropped"][str(HOSTILE)].startswith("quarantined: failed in 3 rounds")
        assert lines[2]["dropped"] == [HOSTILE] and lines[3]["failed"] == {}
        assert [entry.split(":")[0] for entry in summary["failed"][str(HOSTILE)]] == \
            ["round 1", "round 2", "round 3"]
    same_model(hostile.state, honest.state)


@pytest.mark.parametrize("aggregator, modes", [("median", "huge+huge+huge"),
                                               ("krum", "nan+inf+huge")])
def test_under_a_robust_rule_nan_drops_its_sender_and_a_huge_value_is_outvoted(
        tmp_path, aggregator, modes):
    # 1e308 is finite: no breach (docs/strategies.md, "Out of range is the aggregator's to
    # say"). Under median or krum the one hostile rank of five moves nothing out of range;
    # NaN and inf, which used to end the run under these rules, drop its rank for the round.
    hostile = run(config(tmp_path, "robust", workers=5, clients=5, rounds=3,
                         aggregator=aggregator), 5, modes)
    assert hostile.ok and hostile.rounds_completed == 3, hostile.error
    for line, mode in zip(rows(hostile), modes.split("+")):
        assert line["not_served"] == {} and line["dropped"] == [], line
        if mode == "huge":
            assert line["failed"] == {} and HOSTILE in line["served"].values(), line
        else:
            assert list(line["failed"]) == [str(HOSTILE)], line
            assert "holds NaN or inf" in line["failed"][str(HOSTILE)], line
            assert HOSTILE not in line["served"].values(), line
    for key, value in hostile.state.items():
        assert np.isfinite(value).all() and np.abs(value).max() < 10, key


def local_run(tmp_path: Path, name: str, *, workers: int, clients: int, rounds: int,
              hostile: str = "", mesh: str = "", strategy: str = "federated",
              extra: str = "", monkeypatch: Any) -> Any:
    """A ``launch = "local"`` run (its relays and workers spawned for it); rank ``workers``
    misbehaves as ``hostile`` (``MESHKIT_TEST_MISBEHAVE``, read by that node only)."""
    from meshkit.train import Runner

    from tests.support.configs import write_config

    monkeypatch.setenv("MESHKIT_TEST_MISBEHAVE", f"{workers}:{hostile}" if hostile else "")
    config = write_config(
        tmp_path / f"{name}.toml", tmp_path / name, workers=workers, rounds=rounds,
        task="tests.support.hostile_task:Hostile", strategy=strategy, timeout=4.0,
        mesh=mesh, extra=f"clients = {clients}\n{extra}")
    return Runner(str(config)).run()


def assert_named_every_round(report: Any, modes: str, why: list[str | None]) -> None:
    """Each round's ``failed`` names the hostile rank with its reason (a hang: ``dropped``)."""
    lines = rows(report)
    assert [line["round"] for line in lines] == list(range(1, report.rounds + 1))
    for line, expected in zip(lines, why):
        if expected is None:  # the hang: declared dead at the deadline
            assert HOSTILE in line["dropped"], line
        else:
            assert list(line["failed"]) == [str(HOSTILE)], line
            assert expected in line["failed"][str(HOSTILE)], line


@pytest.fixture(scope="module")
def honest_behind_relays(tmp_path_factory):
    """The run of four honest workers behind two relays (shared by the relay tests)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
        return local_run(tmp_path_factory.mktemp("relays"), "honest", workers=4, clients=10,
                         rounds=3, mesh="relays = 2", monkeypatch=patch)


@pytest.mark.parametrize("modes, why", [
    ("error+nan+scalar", ["hostile node: this fit refuses", "NaN or inf", "float64[]"]),
    ("shape+inf+hang", ["float64[65, 32]", "NaN or inf", None]),
    # The relay's own strict mean refuses 1e308 at its boundary (out of its range).
    ("huge+huge+huge", ["is out of range: it holds 1e+308"] * 3),
], ids=["error-nan-scalar", "shape-inf-hang", "huge"])
def test_one_hostile_rank_among_five_behind_host_relays_costs_only_its_own_rank(
        tmp_path, monkeypatch, honest_behind_relays, modes, why):
    # Two relays over five workers (ranks 1-3 and 4-5): the hostile rank 5 shares its
    # relay with an honest one, which the relay still folds and sends up.
    honest = honest_behind_relays
    hostile = local_run(tmp_path, "hostile", workers=5, clients=10, rounds=3, hostile=modes,
                        mesh="relays = 2", monkeypatch=monkeypatch)
    assert hostile.ok and hostile.rounds_completed == 3, hostile.error
    assert_named_every_round(hostile, modes, why)
    for line in rows(hostile):
        assert line["not_served"] == {} and sorted(map(int, line["served"])) == \
            list(range(10)), line
    # A relay folds its ranks' contributions in float64 before the coordinator adds the
    # relays' partials: five workers group the same clients otherwise than four, so the
    # models agree to float64 rounding (the flat and batched rounds above, bit for bit).
    for key, value in honest.state.items():
        np.testing.assert_allclose(hostile.state[key], value, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("modes, why", [
    ("error+nan+scalar", ["hostile node: this fit refuses", "NaN or inf", "float64[]"]),
    ("shape+inf+hang", ["float64[65, 32]", "NaN or inf"]),
], ids=["error-nan-scalar", "shape-inf-hang"])
def test_one_hostile_rank_among_five_under_fedbuff_finishes_every_step(tmp_path, monkeypatch,
                                                                       modes, why):
    # fedbuff asks for one fit at a time: the hostile node's n-th fit does the n-th thing.
    # The virtual clock decides which worker fits what whatever the machine's load, so
    # the hostile rank is given its fits in the same steps every run.
    hostile = local_run(tmp_path, "fedbuff", workers=5, clients=10, rounds=12,
                        hostile=f"fit:{modes}", strategy="fedbuff",
                        extra='buffer_size = 3\nconcurrency = 5\n\n[simulation]\n'
                              'clock = "virtual"', monkeypatch=monkeypatch)
    assert hostile.ok and hostile.rounds_completed == 12, hostile.error
    lines = rows(hostile)
    assert [line["round"] for line in lines] == list(range(1, 13))
    summary = json.loads((Path(hostile.out) / "summary.json").read_text())
    failed = summary["failed"][str(HOSTILE)]
    # Each breach is named, in order, in the step it happened (the update dropped).
    assert len(failed) == len(why), failed
    for entry, expected in zip(failed, why):
        assert expected in entry, failed
    if modes.endswith("hang"):
        assert "stall" in summary["dropped"][str(HOSTILE)] or \
            "no answer" in summary["dropped"][str(HOSTILE)], summary["dropped"]
    else:
        assert summary["dropped"][str(HOSTILE)].startswith("quarantined: failed in 3 rounds")
    for line in lines:  # no step ever folded the hostile rank's update
        assert HOSTILE not in line["served"].values() or line["failed"] == {}, line
    for key, value in hostile.state.items():
        assert np.isfinite(value).all(), key
