"""``[transport] mode = "spmd"`` under torchrun: every rank plays its slice; the bits do not move.

Real processes: ``python -m torch.distributed.run --standalone
--nproc-per-node K -m meshkit_torchdist CONFIG`` at 1, 2 and 4 ranks (run side
by side, to keep the suite's time), and ``meshkit run`` of the same job on
the tcp star. A rank SIGKILLed mid-run is a ``PeerLostError`` naming it on
the survivor (which torchrun SIGTERMs: it finishes failing the round first),
the last checkpoint kept.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch.distributed")

from meshkit.checkpoint import load_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow

JOB = """\
[run]
task = "digits"
seed = 5
out = "{out}"

[mesh]
transport = "{transport}"
workers = 2
timeout = {timeout}

{transport_table}

[strategy]
name = "federated"
rounds = {rounds}
clients = 12
fraction = 0.5

[aggregator]
name = "fedavg"
"""

SPMD = '[transport]\nmode = "spmd"'


def _config(tmp_path: Path, name: str, *, spmd: bool = True, rounds: int = 2,
            timeout: float = 20) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(JOB.format(out=tmp_path / name, transport="torchdist" if spmd else "tcp",
                               transport_table=SPMD if spmd else "", rounds=rounds,
                               timeout=timeout))
    return path


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("MESHKIT_SECRET", None)
    return env


def test_one_two_and_four_ranks_reach_the_same_model_bit_for_bit_as_meshkit_run(
        tmp_path: Path) -> None:
    runs = {}
    for ranks in (1, 2, 4):
        runs[ranks] = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             str(ranks), "-m", "meshkit_torchdist", str(_config(tmp_path, f"r{ranks}"))],
            cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True)
    star = subprocess.run([sys.executable, "-m", "meshkit", "run",
                           str(_config(tmp_path, "star", spmd=False))],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    assert star.returncode == 0, star.stdout + star.stderr
    for ranks, process in runs.items():
        output, _ = process.communicate(timeout=240)
        assert process.returncode == 0, output
        assert f"rank 0: run finished: 2/2 round(s) on {ranks} rank(s)" in output, output
        assert output.count("round   2/2") == 1, output  # rank 0 alone reports
    models = {ranks: load_checkpoint(tmp_path / f"r{ranks}") for ranks in runs}
    reference = load_checkpoint(tmp_path / "star")
    for ranks, checkpoint in models.items():
        assert checkpoint.round == 2
        assert checkpoint.report["clients"] == reference.report["clients"]
        for key, value in models[1].state.items():
            assert checkpoint.state[key].tobytes() == value.tobytes(), (ranks, key)
        served = {int(c): r for c, r in checkpoint.report["served"].items()}
        assert served == {c: i % ranks for i, c in enumerate(sorted(served))}
    for key, value in reference.state.items():  # the star's batched round: the same sums
        assert models[1].state[key].tobytes() == value.tobytes(), key


def _rank_pid(launcher: subprocess.Popen, rank: int) -> int:
    """The pid of torchrun's worker of ``rank`` (its child whose environment says so)."""
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    for pid in children:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(pid)
    raise AssertionError(f"torchrun has no rank {rank} among {children}")


def test_a_rank_lost_mid_run_fails_the_round_naming_it_and_keeps_the_checkpoint(
        tmp_path: Path) -> None:
    config = _config(tmp_path, "lost", rounds=100_000, timeout=10)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", "-m", "meshkit_torchdist", str(config)], cwd=tmp_path, env=_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert launcher.stdout is not None
        for _ in range(50):  # bounded: the lines up to the second round's
            line = launcher.stdout.readline()
            if not line or line.startswith("round   2/"):
                break
        assert line.startswith("round   2/"), line
        # torchrun then SIGTERMs rank 0, which finishes failing the round first.
        os.kill(_rank_pid(launcher, 1), signal.SIGKILL)
        output, _ = launcher.communicate(timeout=90)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0, output
    assert "meshkit_torchdist: rank 0: " in output and "rank 1 lost" in output, output
    assert "Traceback" not in output.split("meshkit_torchdist: rank 0: ")[0]
    summary = json.loads((tmp_path / "lost" / "summary.json").read_text())
    assert not summary["ok"] and "rank 1 lost" in summary["error"], summary
    assert "--resume" in summary["error"]
    assert load_checkpoint(tmp_path / "lost").round >= 2


def test_a_transport_key_an_spmd_run_does_not_use_is_refused_before_it_connects(
        tmp_path: Path) -> None:
    from meshkit import ConfigError
    from meshkit.config import load_config
    from meshkit_torchdist.spmd import run_spmd

    path = _config(tmp_path, "idle")
    path.write_text(path.read_text().replace('mode = "spmd"',
                                             'mode = "spmd"\nmax_frame_bytes = 4096'))
    with pytest.raises(ConfigError, match=r"\[transport\] max_frame_bytes: not used by an"):
        run_spmd(load_config(str(path)), 0, 2, resume=False, overwrite=False)


def test_one_hostile_rank_among_five_costs_its_own_slice_and_every_rank_finishes(
        tmp_path: Path) -> None:
    # Rank 4 of five torchrun processes fits as tests/support/hostile_task.py says (an
    # error, NaN, 1e308); the others are honest. Each rank checks its own fits before its
    # exact partial: rank 4's clients (4 and 9) are not served, every rank finishes.
    config = tmp_path / "hostile.toml"
    config.write_text(JOB.format(out=tmp_path / "hostile", transport="torchdist",
                                 transport_table=SPMD, rounds=3, timeout=20).replace(
        'task = "digits"', 'task = "tests.support.hostile_task:Hostile"').replace(
        "fraction = 0.5", "fraction = 1.0").replace("clients = 12", "clients = 10"))
    env = {**_env(), "MESHKIT_TEST_MISBEHAVE": "4:error+nan+huge",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                          *filter(None, [os.environ.get("PYTHONPATH")])])}
    ran = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "5", "-m", "meshkit_torchdist", str(config)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = ran.stdout + ran.stderr
    assert ran.returncode == 0, output
    assert "rank 0: run finished: 3/3 round(s) on 5 rank(s)" in output, output
    rows = [json.loads(line) for line in
            (tmp_path / "hostile" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for row in rows:  # rank 0's rows: the reason is rank 4's to tell; the sum says who
        assert sorted(map(int, row["served"])) == [0, 1, 2, 3, 5, 6, 7, 8], row
        assert row["not_served"] == {"4": "rank 4 could not serve it",
                                     "9": "rank 4 could not serve it"}, row
