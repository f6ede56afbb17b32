"""``[compression] residual = "worker"`` end to end: real processes, real sockets, what the
transport counted.

* error feedback's upload is a 32nd of the float32 model's bytes *on the wire*: the
  residual stays on the worker, in no request and no reply;
* the model is the bits of the run whose coordinator keeps the residuals (the same
  arithmetic, placed elsewhere);
* ``--resume`` restarts every client's error feedback from zero, and says so.
"""

from __future__ import annotations

import signal

import pytest

from meshkit.checkpoint import load_checkpoint
from meshkit.train import read_metrics

from tests.support.cli import check_in_process, run_cli
from tests.support.configs import KILLER, write_config

pytestmark = pytest.mark.slow

#: A wider digits model (64 x 512 + 512 x 10 + biases = 38,410 float64 coordinates), so a
#: reply's fixed part (metrics, names, framing) is small beside its payload.
WIDE = "\n[task]\nhidden = 512\n"
COORDS = 64 * 512 + 512 + 512 * 10 + 10
#: 1.3 %: 501 of the 38,410 coordinates kept, 4,008 bytes of payload and the names of its
#: eight entries -- under float32's 32nd (4,801 bytes) with them.
TOPK = '\n[compression]\nname = "top-k"\nfraction = 0.013\n'


def _run(tmp_path, name, extra, *, task_table="", rounds=2, clients=2):
    config = write_config(tmp_path / f"{name}.toml", tmp_path / name, workers=2,
                          rounds=rounds, extra=f"clients = {clients}\n" + extra + task_table)
    result = run_cli("run", str(config), cwd=str(tmp_path), timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    return read_metrics(tmp_path / name)


def test_the_worker_kept_residual_never_travels_and_the_upload_is_a_32nd_of_float32(tmp_path):
    # Two clients on two workers: every round is flat, each client uploads one reply.
    whole = _run(tmp_path, "whole", "", task_table=WIDE)
    kept_here = _run(tmp_path, "coordinator", TOPK + WIDE)
    kept_there = _run(tmp_path, "worker", TOPK + 'residual = "worker"\n' + WIDE)
    for rows in (whole, kept_here, kept_there):
        assert [r["round"] for r in rows] == [1, 2]
    assert all(r["residual_restarts"] == 0 for r in kept_there)
    model = 8 * COORDS  # float64
    float32 = 4 * COORDS
    up = {name: rows[-1]["bytes_up"] for name, rows in
          (("whole", whole), ("coordinator", kept_here), ("worker", kept_there))}
    # Measured: a whole fit's reply beyond its model's bytes (metrics, key names, framing).
    fixed = up["whole"] / 2 - model
    assert 0 < fixed < 2048, up
    # What a worker-kept reply carries beyond that fixed part -- the top-k payload and its
    # entries' names -- is at most a 32nd of the float32 model's bytes.
    assert up["worker"] / 2 - fixed <= float32 / 32, (up, fixed)
    assert up["worker"] <= up["whole"] / 32, up  # raw, against the float64 round measured
    # With the coordinator's store each reply also carries the float32 residual: 153,640
    # bytes a client. A residual that travelled would break the bound above 30 times over.
    assert up["coordinator"] - up["worker"] >= 2 * float32, up
    # Nor does it go down: the worker-kept run's requests cost the uncompressed run's (the
    # model whole, a compress field), while round 2's of the coordinator's store carry
    # each client's residual.
    down = {name: rows[-1]["bytes_down"] for name, rows in
            (("whole", whole), ("coordinator", kept_here), ("worker", kept_there))}
    assert down["worker"] <= down["whole"] + 2 * 1024, down
    assert down["coordinator"] - down["worker"] >= 2 * float32, down
    # Same arithmetic wherever the residual is kept: the same model bits.
    a, b = load_checkpoint(tmp_path / "worker"), load_checkpoint(tmp_path / "coordinator")
    for key in b.state:
        assert a.state[key].tobytes() == b.state[key].tobytes(), key
    assert not a.clients  # nothing of a residual reached the coordinator's checkpoint


@pytest.mark.parametrize("layout", ["", 'index = "gap8"\nvalue_bits = 4\n'],
                         ids=["u32-float32", "gap8-4-bit"])
def test_residuals_kept_by_workers_give_the_coordinator_stores_model_bits(tmp_path, layout):
    # Four clients on two workers, four rounds: the coordinator's store plays the compressed
    # batched round (any worker serves any client), the worker-kept run a flat round of
    # pinned clients; each client's error feedback is the same arithmetic, so the model is
    # the same bits -- with the packed layout too (gaps and 4-bit codes: the residual then
    # holds each kept value's rounding error as well).
    ef = '\n[compression]\nname = "top-k"\nfraction = 0.05\n' + layout
    here = _run(tmp_path, "coordinator", ef, rounds=4, clients=4)
    there = _run(tmp_path, "worker", ef + 'residual = "worker"\n', rounds=4, clients=4)
    off = _run(tmp_path, "off", ef + "error_feedback = false\n", rounds=4, clients=4)
    a, b, c = (load_checkpoint(tmp_path / n) for n in ("worker", "coordinator", "off"))
    assert a.round == b.round == 4
    for key in b.state:
        assert a.state[key].tobytes() == b.state[key].tobytes(), key
    # ... and error feedback did something: without it the model differs.
    assert any(a.state[k].tobytes() != c.state[k].tobytes() for k in a.state)
    assert [r["accuracy"] for r in here] == [r["accuracy"] for r in there]
    assert [r["accuracy"] for r in off] != [r["accuracy"] for r in there]


def test_a_resumed_run_restarts_error_feedback_from_zero_and_says_so(tmp_path):
    (tmp_path / "killer.py").write_text(KILLER)
    extra = ('clients = 4\n\n[compression]\nname = "top-k"\nfraction = 0.05\n'
             'residual = "worker"\n')
    config = write_config(tmp_path / "crashed.toml", tmp_path / "crashed", workers=2,
                          rounds=4, task="killer:Killer", extra=extra)
    env = {"PYTHONPATH": str(tmp_path)}
    first = run_cli("run", str(config), cwd=str(tmp_path), timeout=180,
                    env={**env, "KILL_AT_FIT": "5", "KILL_MARK": str(tmp_path / "killed")})
    assert first.returncode == -signal.SIGKILL, first.stdout + first.stderr
    killed_after = load_checkpoint(tmp_path / "crashed").round
    assert 1 <= killed_after < 4
    resumed = run_cli("run", str(config), "--resume", cwd=str(tmp_path), timeout=180, env=env)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "restarts from a zero residual" in resumed.stdout + resumed.stderr
    rows = read_metrics(tmp_path / "crashed")
    assert rows[-1]["round"] == 4
    assert not load_checkpoint(tmp_path / "crashed").clients


#: A digits task whose worker process dies at its ``DIE_AT_FIT``-th fit (the first to get
#: there; the mark file says which).
DYING = '''
import os, signal
from meshkit_tasks.digits import DigitsTask


class Dying(DigitsTask):
    fits = 0

    def fit(self, *args, **kwargs):
        Dying.fits += 1
        if str(Dying.fits) == os.environ.get("DIE_AT_FIT"):
            try:
                os.close(os.open(os.environ["DIE_MARK"], os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        return super().fit(*args, **kwargs)
'''


def test_a_lost_workers_clients_move_and_restart_from_zero_counted(tmp_path):
    (tmp_path / "dying.py").write_text(DYING)
    extra = ('clients = 6\nmin_clients = 1\n\n[compression]\nname = "top-k"\n'
             'fraction = 0.05\nresidual = "worker"\n')
    config = write_config(tmp_path / "job.toml", tmp_path / "out", workers=2, rounds=4,
                          task="dying:Dying", extra=extra)
    # A worker serves about 3 clients a round: its 7th fit is in round 3.
    result = run_cli("run", str(config), cwd=str(tmp_path), timeout=180,
                     env={"PYTHONPATH": str(tmp_path), "DIE_AT_FIT": "7",
                          "DIE_MARK": str(tmp_path / "died")})
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "died").exists()
    rows = read_metrics(tmp_path / "out")
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    moved = [r["residual_restarts"] for r in rows]
    # Until the loss nobody moved; the lost rank's clients moved once, to the rank left.
    assert moved[0] == moved[1] == 0, moved
    assert sum(moved) >= 1 and moved[-1] == 0, moved
    assert len(rows[-1]["served"]) == 6 and len(set(rows[-1]["served"].values())) == 1
    assert "restart error feedback from a zero residual" in result.stdout + result.stderr


def test_check_says_the_residual_stays_on_the_worker(tmp_path):
    config = write_config(tmp_path / "job.toml", tmp_path / "out", workers=2, rounds=1,
                          extra='clients = 4\n\n[compression]\nname = "top-k"\n'
                                'fraction = 0.015\nresidual = "worker"\n')
    result = check_in_process(str(config))
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("upload:"))
    assert "residual (9,640 bytes a client) stays on the worker each client is pinned to" \
        in line, line
    bad = write_config(tmp_path / "bad.toml", tmp_path / "out", workers=2, rounds=1,
                       extra='clients = 4\n\n[compression]\nname = "quantize"\n'
                             'residual = "worker"\n')
    result = check_in_process(str(bad))
    assert result.returncode == 2 and "CompressionTraits.stateful" in result.stderr, \
        result.stderr
    typo = write_config(tmp_path / "typo.toml", tmp_path / "out", workers=2, rounds=1,
                        extra='clients = 4\n\n[compression]\nname = "top-k"\n'
                              'residual = "node"\n')
    result = check_in_process(str(typo))
    assert result.returncode == 2 and "[compression] residual" in result.stderr, \
        result.stderr


def test_with_broadcast_the_model_goes_down_as_deltas_and_the_bits_are_the_default_modes(
        tmp_path):
    ef = '\n[compression]\nname = "top-k"\nfraction = 0.05\nbroadcast = true\n'
    here = _run(tmp_path, "coordinator", ef, rounds=3, clients=4)
    there = _run(tmp_path, "worker", ef + 'residual = "worker"\n', rounds=3, clients=4)
    a, b = load_checkpoint(tmp_path / "worker"), load_checkpoint(tmp_path / "coordinator")
    for key in b.state:
        assert a.state[key].tobytes() == b.state[key].tobytes(), key
    # Neither direction carries a residual (2,410 float32 coordinates, 9,640 bytes a
    # client); the worker-kept run's requests are one a client, each naming its generation.
    for way in ("bytes_down", "bytes_up"):
        assert here[-1][way] - there[-1][way] >= 0.9 * 4 * 9640, (way, here[-1], there[-1])


def test_gaps_and_4_bit_values_keep_3_8x_the_coordinates_in_the_same_32nd_on_the_wire(
        tmp_path):
    # The wide model again: at fraction 0.05 top-k keeps 1,922 coordinates (3.8x the 501 of
    # the u32/float32 test above), as uint8 gaps and 4-bit codes (12 bits an entry, 3,125
    # bytes at the bound with every filler and scale), the residual kept by the worker.
    whole = _run(tmp_path, "whole", "", task_table=WIDE)
    packed = _run(tmp_path, "packed", '\n[compression]\nname = "top-k"\nfraction = 0.05\n'
                  'index = "gap8"\nvalue_bits = 4\nresidual = "worker"\n' + WIDE)
    assert all(r["residual_restarts"] == 0 for r in packed)
    model, float32 = 8 * COORDS, 4 * COORDS
    up = {"whole": whole[-1]["bytes_up"], "packed": packed[-1]["bytes_up"]}
    fixed = up["whole"] / 2 - model
    assert 0 < fixed < 2048, up
    # Measured by the transport: a reply less its fixed part is at most float32's 32nd
    # (3,857 bytes of 4,801 when written) ...
    assert up["packed"] / 2 - fixed <= float32 / 32, (up, fixed)
    # ... and most of it is the 1,922 entries (2,883 bytes of codes and gaps without a
    # filler), not framing: the bytes went on coordinates.
    assert up["packed"] / 2 - fixed > 1922 * 1.5, (up, fixed)
    assert packed[-1]["accuracy"] > 0.5
