"""Signed secure rounds over real processes, and a second client implementation beside meshkit's.

Three ``meshkit node`` workers with ``--key`` and ``--roster`` (the run's
``[mesh] authorized_nodes``) play a secure ``digits`` run. In the second run
rank 3 is ``python -m meshkit_secondclient.node``: the package in
``tests/fixtures/meshkit-secondclient``, installed for real with pip, whose
secure clients were written from docs/protocol.md §7.2-7.2.2 only (no
import of meshkit's scheme plugin); it signs, checks, confirms and masks
beside meshkit's clients, and the run's model is the first run's bit for
bit. In the third, rank 2's roster lacks rank 1's key: it refuses the
round's adverts and only its clients leave. The last adds distributed DP
(``[privacy] placement = "distributed"``): the clients' Skellam shares go
under signed masks, every survivor confirms the set, and each round reports
its epsilon.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from meshkit import wire
from meshkit.checkpoint import load_checkpoint
from meshkit.train import read_metrics
from meshkit.train._rounds import secure as secure_round
from tests.support.cli import pip_install_target, plugin_env
from tests.support.configs import external_config
from tests.support.nodes import run_with_nodes, spawn_node

pytestmark = pytest.mark.slow

PACKAGE = Path(__file__).resolve().parents[2] / "fixtures" / "meshkit-secondclient"
SECRET = b"signed-secure-rounds-secret-0123456789"
WORKERS = 3


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> str:
    target = tmp_path_factory.mktemp("secondclient-site")
    pip_install_target(target, PACKAGE)
    return str(target)


def _keys(root: Path) -> tuple[dict[int, Path], Path]:
    """A node key per rank, and the authorized_nodes file admitting them all (mode 0600)."""
    root.mkdir(parents=True, exist_ok=True)
    keys, lines = {}, []
    for rank in range(1, WORKERS + 1):
        keys[rank] = root / f"node{rank}.key"
        public = wire.generate_node_key(keys[rank])
        lines.append(wire.public_key_text(public, f"rank={rank}"))
    authorized = root / "authorized_nodes"
    authorized.write_text("\n".join(lines) + "\n")
    authorized.chmod(0o600)
    return keys, authorized


# interleave = false: the tests name the clients each rank plays (client order).
SECURE = """
    clients = 6

    [secure_aggregation]
    name = "secagg+"
    clip_range = 1.0
    interleave = false
"""


def _run(tmp_path: Path, keys: dict[int, Path], authorized: Path,
         rosters: dict[int, Path] | None = None, second: tuple[int, str] | None = None,
         extra: str = SECURE) -> Path:
    """One secure run over ``WORKERS`` nodes; ``second = (rank, site)`` runs that rank as the
    second client; ``extra`` the ``[strategy]`` lines and the tables after them. Returns the
    run's output directory."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = external_config(tmp_path, workers=WORKERS, rounds=2, secret=SECRET,
                             mesh=f'authorized_nodes = "{authorized}"', extra=extra)
    secret = tmp_path / "secret"

    def start(address: str) -> list[subprocess.Popen]:
        procs = []
        for rank in range(1, WORKERS + 1):
            flags = ["--key", str(keys[rank]),
                     "--roster", str((rosters or {}).get(rank, authorized))]
            if second is not None and rank == second[0]:
                env = {k: v for k, v in plugin_env(second[1]).items() if k != "MESHKIT_SECRET"}
                log = (tmp_path / "second.log").open("w")
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "meshkit_secondclient.node", "--rank", str(rank),
                     "--world", str(WORKERS + 1), "--peers", address, "--secret-file",
                     str(secret), "--timeout", "20", *flags],
                    stdout=subprocess.DEVNULL, stderr=log, text=True, env=env))
            else:
                procs.append(spawn_node(rank, WORKERS + 1, address, secret, *flags))
        return procs

    run_with_nodes(config, start, timeout=300)
    return tmp_path / "out"


def test_a_second_client_written_from_the_docs_plays_signed_rounds_beside_meshkits(tmp_path,
                                                                                   site):
    keys, authorized = _keys(tmp_path / "keys")
    ours = _run(tmp_path / "meshkit", keys, authorized)
    mixed = _run(tmp_path / "mixed", keys, authorized, second=(3, site))
    log = (tmp_path / "mixed" / "second.log").read_text()
    assert "the second implementation's" in log
    for op in ("secagg_keys", "secagg_share", "secagg_mask", "secagg_confirm", "secagg_unmask"):
        assert f"answered {op}" in log, op
    for out in (ours, mixed):
        rows = read_metrics(out)
        assert [r["round"] for r in rows] == [1, 2]
        for row in rows:
            assert sorted(map(int, row["served"])) == list(range(6)), row
            assert row["secure_sum_of"] == 6 and not row.get("failed")
    # Rank 3 played clients 2 and 5 with the second implementation; the sum is exact, so
    # the model is the all-meshkit run's bit for bit.
    assert {c for c, r in read_metrics(mixed)[0]["served"].items() if r == 3} == {"2", "5"}
    a, b = load_checkpoint(ours), load_checkpoint(mixed)
    assert a.round == b.round == 2
    for key, value in a.state.items():
        assert b.state[key].tobytes() == value.tobytes(), key


def test_a_worker_whose_roster_lacks_a_key_refuses_and_only_its_clients_leave(tmp_path):
    keys, authorized = _keys(tmp_path / "keys")
    partial = tmp_path / "keys" / "partial"
    partial.write_text("".join(line + "\n" for line in authorized.read_text().splitlines()
                               if not line.endswith("rank=1")))
    os.chmod(partial, 0o600)
    out = _run(tmp_path / "run", keys, authorized, rosters={2: partial})
    for row in read_metrics(out):
        # Rank 2 (clients 1 and 4) refuses rank 1's clients' adverts before sharing.
        assert sorted(map(int, row["served"])) == [0, 2, 3, 5], row
        assert "SignatureError" in row["failed"]["2"] and "client 0's advert" in \
            row["failed"]["2"]


DISTRIBUTED_DP = """
    clients = 6

    [privacy]
    name = "dp-fixed"
    placement = "distributed"
    clip = "client"
    clip_norm = 1.0
    noise_multiplier = 1.0
    delta = 1e-5

    [secure_aggregation]
    name = "secagg+"
"""


def test_a_signed_round_with_distributed_dp_confirms_the_survivors_and_reports_epsilon(
        tmp_path, monkeypatch):
    # The coordinator runs in this process: count its consistency checks (a signed round's).
    confirmed = []
    step = secure_round._confirm_step

    def counting(*args: Any, **kwargs: Any) -> Any:
        fields = step(*args, **kwargs)
        confirmed.append(list(fields["confirmed"]))
        return fields

    monkeypatch.setattr(secure_round, "_confirm_step", counting)
    keys, authorized = _keys(tmp_path / "keys")
    rows = read_metrics(_run(tmp_path / "run", keys, authorized, extra=DISTRIBUTED_DP))
    assert [r["round"] for r in rows] == [1, 2]
    assert confirmed == [list(range(6))] * 2  # every survivor signed the set, each round
    epsilons = [r["epsilon"] for r in rows]
    assert 0 < epsilons[0] < epsilons[1] and math.isfinite(epsilons[1])
    for row in rows:
        assert sorted(map(int, row["served"])) == list(range(6)) and not row.get("failed")
        assert row["secure_sum_of"] == 6
        # every client's Skellam share reached the sum: the calibrated noise, all of it
        assert row["noise_multiplier_realized"] == pytest.approx(1.0, rel=1e-3)
        assert 0 < row["round_epsilon"] <= row["epsilon"]
        assert math.isfinite(row["loss"])
