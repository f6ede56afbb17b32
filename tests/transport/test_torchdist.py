"""The torchdist transport: the transport contract over gloo, its all-reduce, and its refusals."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

pytest.importorskip("torch.distributed")

import torch.distributed as dist  # noqa: E402

from meshkit import PeerLostError, RefusedError, plugins  # noqa: E402
from meshkit.node.config import NodeConfig  # noqa: E402
from meshkit.testing import TransportContract  # noqa: E402
from meshkit_tcp.testing import run_ranks  # noqa: E402
from meshkit_torchdist.group import TorchdistLinks, is_loopback  # noqa: E402

#: Every rank is a thread forming a gloo group: run alone, not beside another test.
pytestmark = pytest.mark.serial


class TestTorchdist(TransportContract):
    """Every rank is a thread with its own gloo pairs, meeting at a TCPStore on rank 0."""

    component = "torchdist"

    def test_connecting_without_a_secret_is_refused(self) -> None:
        pytest.skip("does not apply: torch.distributed authenticates nothing, so torchdist "
                    "has no secret to check; it refuses a non-loopback address instead "
                    "(test_a_non_loopback_address_is_refused_without_trust_network)")


def _world(world: int, timeout: float = 5.0, **options) -> tuple:
    transport = plugins.create("transport", "torchdist", options or None)
    coordinator = transport.connect(NodeConfig(rank=0, world=world, bind="127.0.0.1:0",
                                               transport="torchdist", timeout=timeout))
    configs = [NodeConfig(rank=r, world=world, peers=[coordinator.address],
                          transport="torchdist", timeout=timeout) for r in range(1, world)]
    return transport, coordinator, configs


def test_the_all_reduce_is_the_engines_weighted_mean_over_the_workers(monkeypatch) -> None:
    import meshkit.transport._collective as collective

    def no_ring(*args, **kwargs):
        raise AssertionError("torchdist must sum with torch.distributed, not meshkit's ring")

    monkeypatch.setattr(collective, "ring_sum", no_ring)
    transport, coordinator, configs = _world(4)
    try:
        def worker(group):
            x = np.full((3, 5), float(group.rank), np.float32)
            return group.mesh_all_reduce({"x": x, "d": x.astype(np.float64)},
                                         weight=float(group.rank), ranks=[1, 2, 3])

        results = run_ranks(configs, worker, close=False)
        got = results.join(30)
    finally:
        for group in results.groups.values():
            group.close()
        coordinator.close()
    want = (1 + 4 + 9) / 6
    for rank, state in got.items():
        assert state["x"].dtype == np.float32 and state["d"].dtype == np.float64
        np.testing.assert_allclose(state["x"], want, rtol=1e-6)
        np.testing.assert_allclose(state["d"], want, rtol=1e-12)


def test_a_lost_rank_is_a_peer_lost_error_within_the_timeout() -> None:
    transport, coordinator, configs = _world(3, timeout=2.0)
    try:
        def worker(group):
            if group.rank == 2:
                return None  # leaves (closes its group) without joining the all-reduce
            return group.mesh_all_reduce({"x": np.ones(4, np.float32)}, ranks=[1, 2])

        ranks = run_ranks(configs, worker)
        ranks.join(30, raise_errors=False)
        with pytest.raises(PeerLostError, match="rank 2"):
            coordinator.recv(2, 5, timeout=10)
    finally:
        coordinator.close()
    assert isinstance(ranks.errors.get(1), PeerLostError), ranks.errors


def test_a_non_loopback_address_is_refused_without_trust_network() -> None:
    transport = plugins.create("transport", "torchdist", {"init_method": "tcp://10.1.2.3:29500"})
    with pytest.raises(RefusedError, match=r"trust_network") as info:
        transport.connect(NodeConfig(rank=1, world=2, transport="torchdist", timeout=1))
    assert "authenticates nothing" in str(info.value)


def test_env_rendezvous_refuses_a_non_loopback_master_addr(monkeypatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.7")
    monkeypatch.setenv("MASTER_PORT", "29500")
    transport = plugins.create("transport", "torchdist", {"init_method": "env://"})
    with pytest.raises(RefusedError, match=r"MASTER_ADDR.*\[mesh\] trust_network = true"):
        transport.connect(NodeConfig(rank=1, world=2, transport="torchdist", timeout=1))


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("localhost", True),
                                            ("::1", True), ("10.0.0.1", False),
                                            ("192.0.2.7", False)])
def test_what_counts_as_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_a_failing_store_is_not_reported_as_a_slow_peer(caplog):
    # Before, any failure to form a pair group read "did not join the
    # torch.distributed world within N s": a broken store blamed the peer.
    rank = types.SimpleNamespace(rank=1, join_timeout=5.0)
    timeout = dist.DistStoreError("wait timeout after 5000ms, keys: /meshkit/pair/1-2/0")
    assert TorchdistLinks._pair_failure(rank, 2, timeout).startswith(
        "did not join the torch.distributed world within 5 s (wait timeout")
    broken = dist.DistNetworkError("Connection reset by peer")
    with caplog.at_level("ERROR", logger="meshkit_torchdist.group"):
        reason = TorchdistLinks._pair_failure(rank, 2, broken)
    assert reason.startswith("could not form the gloo pair group: DistNetworkError: "
                             "Connection reset by peer (the rendezvous store or the network")
    assert "forming the pair group with rank 2 failed" in caplog.text


def test_the_torchrun_launcher_is_a_click_command_with_usage_errors_exit_2(capsys, monkeypatch):
    from meshkit_torchdist.launch import main

    assert main([]) == 2
    assert "Missing argument 'CONFIG'" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["/nonexistent/run.toml"]) == 2
    assert "meshkit_torchdist: rank 1: /nonexistent/run.toml: no such config file" \
        in capsys.readouterr().err


def _own_non_loopback_address() -> str:
    """One of this machine's own non-loopback IPv4 addresses (``hostname -I``), or skip."""
    import ipaddress
    import subprocess

    try:
        words = subprocess.run(["hostname", "-I"], capture_output=True, text=True,
                               timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        words = []
    for word in words:
        try:
            address = ipaddress.ip_address(word)
        except ValueError:
            continue
        if address.version == 4 and not address.is_loopback:
            return word
    pytest.skip("this machine has no non-loopback IPv4 address to rendezvous on")


def _run_on(tmp_path, host: str, *, trust: bool, command: str = "run"):
    from tests.support.cli import run_cli

    config = tmp_path / "run.toml"
    config.write_text(f"""
[run]
task = "digits"
out = "{tmp_path / 'out'}"

[mesh]
workers = 2
transport = "torchdist"
bind = "{host}:0"
timeout = 10
trust_network = {'true' if trust else 'false'}

[strategy]
name = "federated"
rounds = 1
clients = 2
""")
    return run_cli(command, *(["-q"] if command == "run" else []), str(config), timeout=240)


@pytest.mark.parametrize("command", ["check", "run"])
def test_a_run_rendezvousing_on_this_machines_own_address_is_refused_clearly(tmp_path, command):
    # Issue 34: a non-loopback rendezvous must be the trust refusal (exit 2, one
    # paragraph naming the file and the key), never an OSError or a traceback -- and
    # meshkit check, which said ok, refuses it as run does (the transport's declared
    # TransportTraits, read before anything starts).
    host = _own_non_loopback_address()
    ran = _run_on(tmp_path, host, trust=False, command=command)
    assert ran.returncode == 2, ran.stderr
    assert "Traceback" not in ran.stderr and "OSError" not in ran.stderr
    assert ran.stderr.startswith(
        f"meshkit: error: {tmp_path / 'run.toml'}: [mesh] bind = '{host}:0' puts the torchdist "
        f"rendezvous on '{host}', not a loopback address, and transport 'torchdist' "
        f"authenticates nothing"), ran.stderr
    assert "set [mesh] trust_network = true only on a network you trust" in ran.stderr
    assert len(ran.stderr.strip().splitlines()) == 1, ran.stderr


def test_check_refuses_a_non_loopback_init_method_or_master_addr(tmp_path, monkeypatch):
    from tests.support.cli import run_cli

    config = tmp_path / "run.toml"
    base = f"""
[run]
task = "digits"
out = "{tmp_path / 'out'}"

[mesh]
workers = 2
transport = "torchdist"

[strategy]
name = "federated"
rounds = 1
"""
    config.write_text(base + '\n[transport]\ninit_method = "tcp://192.0.2.7:29500"\n')
    ran = run_cli("check", str(config), timeout=120)
    assert ran.returncode == 2 and "Traceback" not in ran.stderr, ran.stderr
    assert (f"{config}: [transport] init_method = 'tcp://192.0.2.7:29500' puts the torchdist "
            f"rendezvous on '192.0.2.7'") in ran.stderr
    config.write_text(base + '\n[transport]\ninit_method = "env://"\n')
    ran = run_cli("check", str(config), timeout=120,
                  env={"MASTER_ADDR": "192.0.2.7", "MASTER_PORT": "29500"})
    assert ran.returncode == 2 and "Traceback" not in ran.stderr, ran.stderr
    assert (f"{config}: MASTER_ADDR (the environment torchrun sets) puts the torchdist "
            f"rendezvous on '192.0.2.7'") in ran.stderr
    config.write_text(base.replace("workers = 2", "workers = 2\ntrust_network = true")
                      + '\n[transport]\ninit_method = "tcp://192.0.2.7:29500"\n')
    ran = run_cli("check", str(config), timeout=120)
    assert ran.returncode == 0, ran.stderr


@pytest.mark.slow
def test_a_trusted_run_on_this_machines_own_address_reaches_its_local_workers(tmp_path):
    # Before, a local launch did not pass [mesh] trust_network to its workers: each
    # refused the address the coordinator was allowed, and the run waited for them.
    host = _own_non_loopback_address()
    ran = _run_on(tmp_path, host, trust=True)
    assert ran.returncode == 0, ran.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["ok"] is True and summary["rounds_completed"] == 1
