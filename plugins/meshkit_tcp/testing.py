"""Helpers for testing code that runs on a group (threads as ranks).

    from meshkit_tcp.testing import inproc_configs, run_ranks

    configs = inproc_configs(4)                  # rank 0 + 3 workers, one fresh hub
    coordinator = configs[0].connect()
    results = run_ranks(configs[1:], lambda g: g.send(0, 7, {"x": x}) or g.recv(0, 8))
    heard = dict(coordinator.recv(ANY, 7) for _ in configs[1:])   # {rank: state}
    for rank in heard:
        coordinator.send(rank, 8, {"ok": True})
    results.join()                               # {rank: value}, re-raising a worker's error

``run_ranks`` connects each config in its own thread, calls ``fn(group)`` and
closes the group afterwards (unless ``close=False``).
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Sequence

from meshkit.node.config import NodeConfig

__all__ = ["inproc_configs", "tcp_star_configs", "run_ranks", "RankThreads"]

_counter = itertools.count()


def inproc_configs(world: int, *, name: str | None = None, secret: bytes = b"test-secret",
                   timeout: float = 5.0, topology: str = "star") -> list[NodeConfig]:
    """One NodeConfig per rank, all meeting at a fresh in-process hub."""
    hub = name or f"inproc://test-{next(_counter)}-{id(object()):x}"
    peers = [hub] if topology == "star" else [hub] * world
    return [NodeConfig(rank=r, world=world, peers=peers, topology=topology,
                       transport="inproc", secret=secret, timeout=timeout)
            for r in range(world)]


def tcp_star_configs(world: int, coordinator_address: str, *, secret: bytes = b"test-secret",
                     timeout: float = 5.0) -> list[NodeConfig]:
    """Worker configs (ranks 1..world-1) dialing a coordinator already listening."""
    return [NodeConfig(rank=r, world=world, peers=[coordinator_address], topology="star",
                       transport="tcp", secret=secret, timeout=timeout)
            for r in range(1, world)]


class RankThreads:
    """Threads running one rank each; ``join()`` returns ``{rank: result}``."""

    def __init__(self) -> None:
        self.results: dict[int, Any] = {}
        self.errors: dict[int, BaseException] = {}
        self.groups: dict[int, Any] = {}
        self.threads: list[threading.Thread] = []

    def join(self, timeout: float = 60.0, *, raise_errors: bool = True) -> dict[int, Any]:
        for thread in self.threads:
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(f"{thread.name} did not finish within {timeout} s")
        if raise_errors and self.errors:
            rank, error = sorted(self.errors.items())[0]
            raise error
        return dict(self.results)


def run_ranks(configs: Sequence[NodeConfig], fn: Callable[[Any], Any], *,
              close: bool = True) -> RankThreads:
    """Connect each config in a thread and run ``fn(group)`` there."""
    ranks = RankThreads()

    def body(config: NodeConfig) -> None:
        group = None
        try:
            group = config.connect()
            ranks.groups[config.rank] = group
            ranks.results[config.rank] = fn(group)
        except BaseException as exc:  # reported by join()
            ranks.errors[config.rank] = exc
        finally:
            if group is not None and close:
                group.close()

    for config in configs:
        thread = threading.Thread(target=body, args=(config,), daemon=True,
                                  name=f"meshkit-test-rank-{config.rank}")
        ranks.threads.append(thread)
        thread.start()
    return ranks
