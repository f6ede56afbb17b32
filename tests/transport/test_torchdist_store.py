"""torchdist's rendezvous store listens where the rendezvous address says, not on every interface.

What listens is read from ``/proc/net/tcp`` and ``/proc/net/tcp6`` (state
0A, LISTEN): c10d's ``TCPStore`` binds ``[::]`` on its own, which let anyone
on the LAN list and write the pairing keys of a run configured on 127.0.0.1.
"""

from __future__ import annotations

import datetime
import logging
import threading
from pathlib import Path

import pytest

pytest.importorskip("torch.distributed")

import torch.distributed as dist  # noqa: E402

from meshkit import plugins  # noqa: E402
from meshkit.node.config import NodeConfig  # noqa: E402
from meshkit_tcp.testing import run_ranks  # noqa: E402

from meshkit.train import free_ports  # noqa: E402

pytestmark = [pytest.mark.skipif(not Path("/proc/net/tcp").exists(),
                                 reason="reads listening sockets from /proc/net/tcp"),
              pytest.mark.serial]  # gloo groups formed by threads: run alone

LOOPBACK = "0100007F"  # 127.0.0.1 as /proc/net/tcp spells it


def listening(port: int) -> set[str]:
    """The local addresses (hex, as /proc spells them) listening on TCP ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, _, hex_port = fields[1].rpartition(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


def connect(rank: int, world: int, **config):
    return plugins.create("transport", "torchdist").connect(
        NodeConfig(rank=rank, world=world, transport="torchdist", timeout=5.0, **config))


def exchange(group):
    if group.rank == 1:
        group.send(0, 5, {"x": 1})
    return None


def test_a_tcp_rendezvous_on_loopback_listens_on_loopback_only() -> None:
    coordinator = connect(0, 2, bind="127.0.0.1:0")
    try:
        port = int(coordinator.address.rpartition(":")[2])
        assert listening(port) == {LOOPBACK}
        # ... and it is the store the ranks meet at.
        ranks = run_ranks([NodeConfig(rank=1, world=2, peers=[coordinator.address],
                                      transport="torchdist", timeout=5.0)], exchange)
        assert coordinator.recv(1, 5, timeout=10) == {"x": 1}
        ranks.join(30)
    finally:
        coordinator.close()


def test_an_env_rendezvous_on_loopback_listens_on_loopback_only(monkeypatch) -> None:
    (port,) = free_ports(1)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    groups: dict[int, object] = {}
    errors: list[BaseException] = []

    def join(rank: int) -> None:
        try:
            groups[rank] = connect(rank, 2)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    hosting = threading.Thread(target=join, args=(0,), daemon=True)
    hosting.start()
    try:
        # Rank 0 hosts the store, waiting for its worker: it listens by now.
        pause = threading.Event()
        for _ in range(200):  # bounded: 10 s
            if listening(port) or not hosting.is_alive():
                break
            pause.wait(0.05)
        assert listening(port) == {LOOPBACK}
        worker = threading.Thread(target=join, args=(1,), daemon=True)
        worker.start()
        worker.join(30)
        hosting.join(30)
        assert not errors, errors
        groups[1].send(0, 5, {"x": 2})
        assert groups[0].recv(1, 5, timeout=10) == {"x": 2}
    finally:
        for group in groups.values():
            group.close()


def test_under_torchruns_agent_store_rank_0_says_the_store_is_reachable(monkeypatch,
                                                                       caplog) -> None:
    (port,) = free_ports(1)
    # torchrun's agent hosts the store; its workers (rank 0 too) are its clients.
    agent = dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=10),
                          wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level(logging.WARNING, logger="meshkit_torchdist.group"):
        coordinator = connect(0, 1)
    try:
        assert "torchrun's agent store, which torchrun binds on every interface" in caplog.text
    finally:
        coordinator.close()
        del agent
