"""The round engine with real worker processes: a killed worker, and the coordinator's memory."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

from meshkit.train import GroupPool, Runner, read_metrics
from meshkit.wire import _buffers as wire_buffers

from tests.support.configs import write_config
pytestmark = pytest.mark.slow


def synthetic_config(path: Path, out: Path, *, workers: int, rounds: int, clients: int = 0,
                     params: int = 4096, timeout: float = 30.0) -> Path:
    """A federated run of the synthetic task, every client required."""
    extra = (f"clients = {clients}\nmin_clients = {clients or workers}\n"
             f"[task]\nparams = {params}\nrows = 1024")
    return write_config(path, out, workers=workers, rounds=rounds, task="synthetic",
                        extra=extra, timeout=timeout)


def test_a_worker_killed_between_rounds_is_sent_no_client_and_every_client_is_served(
        tmp_path, monkeypatch):
    sent: list[tuple[int, int, str]] = []
    rounds_done = [0]
    original = GroupPool.send

    def recording_send(self, rank, request, timeout):
        sent.append((rounds_done[0] + 1, rank, request.get("op")))
        return original(self, rank, request, timeout)

    monkeypatch.setattr(GroupPool, "send", recording_send)
    procs = {}

    def on_round(report, state):
        rounds_done[0] = report.round
        if report.round == 1:
            procs[2].kill()
            procs[2].wait(10)

    out = tmp_path / "out"
    config = synthetic_config(tmp_path / "c.toml", out, workers=4, rounds=3, clients=8)
    report = Runner(str(config), on_workers=procs.update, on_round=on_round).run()
    assert report.ok and 2 in report.dropped

    rows = read_metrics(out)
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert rows[0]["dropped"] == [] and rows[1]["dropped"] == [2] and rows[2]["dropped"] == []
    for row in rows:
        # Every client of the round is accounted for: served by a rank, or not
        # served with a reason (here none: three live workers serve eight clients).
        assert sorted(map(int, row["served"])) == row["clients"] == list(range(8))
        assert row["not_served"] == {}
    for row in rows[1:]:
        assert set(row["served"].values()) <= {1, 3, 4}, row["served"]
        assert 2 not in row["answered"]
    # After the kill, rank 2 is handed no client: at most the round's state
    # went out before the ledger knew, and it never acknowledged it.
    assert {op for rnd, rank, op in sent if rank == 2 and rnd >= 2} <= {"set_state"}
    assert any(op in ("fit", "fit_batch") for rnd, rank, op in sent if rank == 2 and rnd == 1)


@pytest.mark.parametrize("params", [
    2_000_000,  # 8 MB a model: frames too big for the wire's receive-buffer pool
    750_000,    # 3 MB: pooled frames; the pool is one per process, not one per link
], ids=["8MB", "3MB-pooled"])
def test_coordinator_memory_stays_a_few_model_copies_with_16_workers(tmp_path, params):
    model = params * 4
    out = tmp_path / "out"
    config = synthetic_config(tmp_path / "c.toml", out, workers=16, rounds=2, params=params,
                          timeout=120.0)
    tracemalloc.start()
    try:
        report = Runner(str(config)).run()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.ok
    rows = read_metrics(out)
    assert [len(r["served"]) for r in rows] == [16, 16]
    # The round's state, the fold's accumulator, the contribution it retains
    # and the one arriving: about four copies, whatever the worker count. The
    # engine before collected every reply first: two copies per worker (32).
    # A model of at most 4 MiB also has its frames recycled by the wire: at
    # most _POOL_SIZE of them for the whole process (before, that many per
    # link: 20 copies at 16 workers with a 3 MB model).
    pooled = wire_buffers._POOL_SIZE if model <= wire_buffers._POOL_MAX else 0
    assert peak < (6 + pooled) * model, f"coordinator peak {peak / model:.1f} model copies"
