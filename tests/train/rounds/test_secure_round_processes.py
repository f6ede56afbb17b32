"""A secure run over real worker processes: the exact sum when 0, 10 and 30 % of the cohort
die after masking, the refusal below the threshold, and a coordinator that never holds an
individual update (instrumented)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pytest

import meshkit
import meshkit.plugins
import meshkit.train._pool as pool_module
from meshkit_secagg import ServerRound, SecAggParams, add_mod, quantize, vector_dtype
from meshkit.secure_aggregation import choose
from meshkit.train import Runner, Trainer, client_seed, read_metrics, round_params
from meshkit.train._worker.secure import FAULT_ENV, update_vector, vector_keys

from tests.support.configs import write_config


def secagg(**options: Any) -> Any:
    """The built-in ``secagg+`` scheme with these ``[secure_aggregation]`` options."""
    return choose("secagg+", options)

CLIENTS, SEED = 10, 7
TASK = {"params": 256, "arrays": 2, "rows": 200}
PARAMS = SecAggParams(clients=CLIENTS, degree=0, threshold=6, clip_range=1.0, modulus_bits=32)
#: (round, client) whose worker exits right after sending its masked input. With 7 workers
#: and the cohort planned round-robin over the live ones: round 1 loses nobody; round 2 rank 4
#: (client 3 alone: 10 %); round 3 ranks 6 and 1 (clients 4; 0 and 6: 30 %); round 4 ranks 2
#: and 3 (six clients), which leaves 4 holders of shares, below the threshold of 6 (a strict
#: majority of the 10 holders: 5 would be open to the survivor-set split).
FAULTS = "2:3,3:4,3:0,4:0,4:1"


def task(*fitted: int) -> Any:
    """The runs' synthetic task (``fitted``: the round and client it fits, alike for all)."""
    return meshkit.plugins.create("task", "synthetic", TASK)


def quantised_updates(state: Mapping[str, Any], rnd: int) -> dict[int, np.ndarray]:
    """Every client's quantised update from ``state`` in round ``rnd``, computed in the clear."""
    trainer = Trainer(task(), seed=SEED)
    trainer.handle({"op": "set_state", "seq": 1, "state": dict(state)})
    out = {}
    for client in range(CLIENTS):
        reply = trainer.handle({"op": "fit", "seq": 2, "shard": client, "shards": CLIENTS,
                                "seed": client_seed(SEED, rnd, client)})
        out[client] = quantize(update_vector(reply["state"], state, vector_keys(state)), PARAMS)
    return out


@pytest.mark.slow
def test_a_secure_run_sums_exactly_through_dropouts_and_refuses_below_the_threshold(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, FAULTS)  # read by the worker processes only
    # Instrument the coordinator: every reply frame it takes in, and every sum it unmasks.
    arrays: list[np.ndarray] = []
    decode = pool_module.decode

    def recording(frame: Mapping[str, Any]) -> dict[str, Any]:
        arrays.extend(v for v in frame.values() if isinstance(v, np.ndarray))
        return decode(frame)

    monkeypatch.setattr(pool_module, "decode", recording)
    totals: list[np.ndarray] = []
    finish = ServerRound.finish

    def finishing(self: ServerRound) -> Any:
        result = finish(self)
        totals.append(result.total.copy())
        return result

    monkeypatch.setattr(ServerRound, "finish", finishing)
    states: list[Mapping[str, Any]] = []
    out = tmp_path / "out"
    config = write_config(
        tmp_path / "run.toml", out, workers=7, rounds=4, task="synthetic", timeout=20.0,
        extra=f"clients = {CLIENTS}\n\n[task]\n" + "\n".join(f"{k} = {v}" for k, v in TASK.items())
        + "\n\n[secure_aggregation]\ndegree = 0\nthreshold = 6\nclip_range = 1.0\n"
        + "interleave = false\n")  # the ranks' clients are named below: client order
    runner = Runner(str(config), on_round=lambda r, state: states.append(state))
    # Round 4 lost six clients' holders after masking: four replies cannot rebuild any
    # secret, and the run stops there saying so, its last checkpoint round 3's.
    with pytest.raises(meshkit.RefusedError, match=r"round 4: \[secure_aggregation\]: .*fewer "
                                                   r"than 6 shares among the 4 replies: the "
                                                   r"sum is not unmasked.*round 3\) is intact"):
        runner.run()
    report = runner.report
    assert report is not None and not report.ok and report.rounds_completed == 3
    assert sorted(report.dropped) == [1, 2, 3, 4, 6]
    rows = read_metrics(out)
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert [r["dropped"] for r in rows] == [[], [4], [1, 6]]
    # 0 %, 10 % and 30 % of the cohort died after masking: every input is in each sum, and
    # each unmasked sum is the plaintext fixed-point sum of the same quantised updates.
    start = task().init_state(SEED)
    for rnd, (before, total) in enumerate(zip([start, *states], totals[:3]), start=1):
        assert sorted(map(int, rows[rnd - 1]["served"])) == list(range(CLIENTS))
        updates = quantised_updates(before, rnd)
        expected = np.zeros_like(total)
        for update in updates.values():
            add_mod(expected, update, PARAMS.modulus_bits, out=expected)
        np.testing.assert_array_equal(total, expected)
        # A masked input from a worker playing one client is not that client's update.
        for array in arrays:
            for update in updates.values():
                assert array.shape != update.shape or not np.array_equal(array, update)
    # The coordinator never took in a float array: no model, no update, masked or not.
    assert arrays and not [a for a in arrays if not np.issubdtype(a.dtype, np.integer)]
    assert {a.dtype for a in arrays if a.ndim == 1} <= {np.dtype(np.uint32),
                                                        vector_dtype(PARAMS.modulus_bits)}


HOSTILE = Path(__file__).resolve().parents[2] / "support" / "hostile"


def _run_recording(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, workers: int,
                   clients: int, secure: str, rounds: int = 2, task_name: str = "synthetic",
                   task_table: Mapping[str, Any] = TASK, timeout: float = 30.0
                   ) -> tuple[Any, list[Any], list[Mapping[str, Any]], list[dict[str, Any]]]:
    """A secure run over real worker processes: (report, unmasked totals, states, rows)."""
    totals: list[Any] = []
    finish = ServerRound.finish

    def finishing(self: ServerRound) -> Any:
        result = finish(self)
        totals.append(result)
        return result

    monkeypatch.setattr(ServerRound, "finish", finishing)
    states: list[Mapping[str, Any]] = []
    out = tmp_path / "out"
    config = write_config(
        tmp_path / "run.toml", out, workers=workers, rounds=rounds, task=task_name,
        timeout=timeout,
        extra=f"clients = {clients}\n\n[task]\n"
        + "\n".join(f"{k} = {v}" for k, v in task_table.items())
        + f"\n\n[secure_aggregation]\nclip_range = 1.0\n{secure}\n"
        # The tests name the clients each rank plays (client order) unless they say not.
        + ("" if "interleave" in secure else "interleave = false\n"))
    runner = Runner(str(config), on_round=lambda r, state: states.append(state))
    report = runner.run()
    return report, totals, states, read_metrics(out)


def _exact(totals: list[Any], states: list[Mapping[str, Any]], clients: int,
           *params: SecAggParams, make_task: Any = task) -> None:
    """Each round's unmasked total is the plaintext sum of exactly its contributors' updates.

    ``params`` are each round's (the last one standing for the rounds after it);
    ``make_task(round, client)`` builds the task that fitted ``client`` in ``round``
    (called with no arguments: the run's initial model's).
    """
    start = make_task().init_state(SEED)
    for rnd, (before, result) in enumerate(zip([start, *states], totals), start=1):
        round_params_ = params[min(rnd, len(params)) - 1]
        expected = np.zeros_like(result.total)
        for client in result.contributors:
            trainer = Trainer(make_task(rnd, client), seed=SEED)
            trainer.handle({"op": "set_state", "seq": 1, "state": dict(before)})
            reply = trainer.handle({"op": "fit", "seq": 2, "shard": client, "shards": clients,
                                    "seed": client_seed(SEED, rnd, client)})
            add_mod(expected, quantize(update_vector(reply["state"], before,
                                                     vector_keys(before)), round_params_),
                    round_params_.modulus_bits, out=expected)
        np.testing.assert_array_equal(result.total, expected)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["error", "garbage", "lie"])
def test_one_hostile_rank_among_five_costs_its_own_clients_and_every_round_sums_the_others(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    # Rank 1 of five plays clients 0 and 5 (round-robin). It answers secagg_mask with an
    # error, seals garbage shares, or lies about one client's seed through both its clients.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(HOSTILE), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("MESHKIT_TEST_HOSTILE", f"1:{mode}")
    # The complete graph and t = 6: the liar's two clients are among the first six holders
    # of any secret, where leaving out one holder at a time cannot find them.
    report, totals, states, rows = _run_recording(
        tmp_path, monkeypatch, workers=5, clients=CLIENTS, secure="degree = 0\nthreshold = 6")
    assert report.ok and [r["round"] for r in rows] == [1, 2]
    params = SecAggParams(clients=CLIENTS, degree=0, threshold=6, clip_range=1.0)
    _exact(totals, states, CLIENTS, params)
    first = rows[0]
    if mode == "lie":  # masked already: in the sum, its replies discarded, rank 1 dropped
        assert sorted(map(int, first["served"])) == list(range(CLIENTS))
    else:
        assert sorted(map(int, first["served"])) == [c for c in range(CLIENTS) if c not in (0, 5)]
        why = first["not_served"]["0"]
        assert ("rank 1 failed: secagg_mask: RuntimeError: hostile worker" in why
                if mode == "error" else "shares for client" in why and "rank 1" in why), why
    # Only the hostile rank is ever dropped; with an error reply not even it (it plays on).
    assert list(report.dropped) == ([] if mode == "error" else [1])
    if mode == "error":  # not declared dead: it fails, and costs its own clients, every round
        assert sorted(map(int, rows[1]["served"])) == [c for c in range(CLIENTS)
                                                       if c not in (0, 5)]
    else:  # declared dead in round 1: round 2 is the others', all ten clients served
        assert sorted(map(int, rows[1]["served"])) == list(range(CLIENTS))


@pytest.mark.slow
def test_four_clients_with_threshold_three_survive_one_dropping_after_masking(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULT_ENV, "1:1")  # rank 2 (client 1) exits once it has masked
    report, totals, states, rows = _run_recording(
        tmp_path, monkeypatch, workers=4, clients=4, secure="degree = 0\nthreshold = 3")
    assert report.ok and [r["round"] for r in rows] == [1, 2]
    assert rows[0]["dropped"] == [2]
    assert sorted(map(int, rows[0]["served"])) == [0, 1, 2, 3]  # its input is in the sum
    _exact(totals, states, 4, SecAggParams(clients=4, degree=0, threshold=3, clip_range=1.0))


@pytest.mark.slow
def test_three_workers_of_four_clients_survive_losing_one_with_the_defaults(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The defaults deal the cohort along the ring: whichever rank plays client 0 exits
    # after masking, and degree 2, threshold 2 (8 and 5 in client order) must survive it.
    monkeypatch.setenv(FAULT_ENV, "1:0")
    report, totals, states, rows = _run_recording(tmp_path, monkeypatch, workers=3,
                                                  clients=12, secure="interleave = true")
    assert report.ok and [r["round"] for r in rows] == [1, 2]
    played = {int(c): int(r) for c, r in rows[0]["served"].items()}
    assert rows[0]["dropped"] == [played[0]]
    assert sorted(played) == list(range(12)) and sorted(set(played.values())) == [1, 2, 3]
    assert (totals[0].contributors, totals[1].contributors) == (tuple(range(12)),) * 2
    first = round_params(secagg(clip_range=1.0), 12, per_worker=4, interleave=3)
    assert (first.degree, first.threshold) == (2, 2)
    # Round 2 plays twelve clients on two workers: the graph grows to survive losing six.
    second = round_params(secagg(clip_range=1.0), 12, per_worker=6)
    assert second.effective_degree == 11
    _exact(totals, states, 12, first, second)


ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
@pytest.mark.parametrize("modes", ["error+nan+scalar", "shape+inf+huge", "hang"])
def test_one_hostile_fit_among_five_secure_workers_costs_its_own_clients(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, modes: str) -> None:
    # The worker code is honest, its task is not (tests/support/hostile_task.py): rank 5
    # (clients 4 and 9) fits NaN, inf, 1e308, a 0-d array, a wrong shape, raises or hangs.
    from tests.support.hostile_task import Hostile, HostileOptions

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("MESHKIT_TEST_MISBEHAVE", f"5:{modes}")
    sequence = modes.split("+")
    report, totals, states, rows = _run_recording(
        tmp_path, monkeypatch, workers=5, clients=CLIENTS, secure="", rounds=len(sequence),
        task_name="tests.support.hostile_task:Hostile", task_table={}, timeout=4.0)
    assert report.ok and report.rounds_completed == len(sequence), report.error
    out = Path(report.out)
    why = {"error": "RuntimeError: hostile node: this fit refuses",
           "nan": "holds NaN or infinity", "inf": "holds NaN or infinity",
           "scalar": "the fit's model has no 'hidden.w' of the round model's shape [64, 32]",
           "shape": "the fit's model has no 'hidden.w' of the round model's shape [64, 32]",
           "hang": "rank 5 was lost (no answer within 4 s (stalled))"}
    for row, mode in zip(rows, sequence):
        served = sorted(map(int, row["served"]))
        if mode == "huge":  # finite: clipped to clip_range, in the sum like any other
            assert served == list(range(CLIENTS)) and row["failed"] == {}, row
            continue
        # Rank 5 plays clients 4 and 9: they leave the round, named; the others are summed.
        assert served == [c for c in range(CLIENTS) if c not in (4, 9)], row
        assert sorted(row["not_served"]) == ["4", "9"], row
        assert all(why[mode] in text for text in row["not_served"].values()), row
        if mode == "hang":
            assert row["dropped"] == [5] and row["failed"] == {}, row
        else:  # its own failure, named in the row's failed as on every other path
            assert list(row["failed"]) == ["5"] and why[mode] in row["failed"]["5"], row
    summary = json.loads((out / "summary.json").read_text())
    if len(sequence) == 3 and "huge" not in sequence:  # failing in 3 rounds: quarantined
        assert summary["dropped"]["5"].startswith("quarantined: failed in 3 rounds"), summary
        assert len(summary["failed"]["5"]) == 3

    def fitted_by(*at: int) -> Any:
        rnd, client = at or (0, 0)
        mode = sequence[rnd - 1] if client in (4, 9) and rnd else ""
        # The hostile node's fit of that round, replayed (its first round is this mode).
        return Hostile(HostileOptions(misbehave=mode if mode == "huge" else ""))

    _exact(totals, states, CLIENTS, round_params(secagg(clip_range=1.0),
                                                 CLIENTS, per_worker=2), make_task=fitted_by)
