"""In-process collective runs: ranks as threads, summed by a barrier (for fast unit tests).

The real reducer (``meshkit_torchdist``'s gloo all-reduce) is exercised by
``tests/transport/test_torchdist_spmd.py`` with torchrun's processes.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

from meshkit import PeerLostError


class ThreadWorld:
    """``world`` threads that sum int64 buffers together; one may be made to vanish."""

    def __init__(self, world: int, timeout: float = 10.0) -> None:
        self.world = world
        self.timeout = timeout
        self.sums = 0
        self._barrier = threading.Barrier(world)
        self._lock = threading.Lock()
        self._buffers: dict[int, np.ndarray] = {}
        self._total: np.ndarray | None = None

    def reducer(self, rank: int) -> ThreadReducer:
        return ThreadReducer(self, rank)

    def _sum(self, rank: int, buffer: np.ndarray, timeout: float | None) -> None:
        with self._lock:
            self._buffers[rank] = buffer.copy()
        try:
            if self._barrier.wait(self.timeout) == 0:
                self._total = np.sum(np.stack([self._buffers[r] for r in range(self.world)]),
                                     axis=0)
                self.sums += 1
            self._barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            raise PeerLostError(f"rank {rank}: a rank did not reach the sum") from None
        assert self._total is not None
        buffer[:] = self._total
        self._barrier.wait(self.timeout)

    def run(self, play: Callable[[ThreadReducer], Any]) -> list[Any]:
        """``play(reducer)`` on every rank, each in its own thread; each rank's result."""
        results: list[Any] = [None] * self.world
        errors: list[BaseException | None] = [None] * self.world

        def one(rank: int) -> None:
            try:
                results[rank] = play(self.reducer(rank))
            except BaseException as exc:  # handed back to the test below
                errors[rank] = exc
                self._barrier.abort()

        threads = [threading.Thread(target=one, args=(r,), daemon=True)
                   for r in range(self.world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
            assert not thread.is_alive(), "a collective rank hung"
        for error in errors:
            if error is not None:
                raise error
        return results


class ThreadReducer:
    """One rank's :class:`meshkit.train.PartialReducer` in a :class:`ThreadWorld`."""

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self._world = world
        self.rank = rank
        self.stop_requested = threading.Event()

    @property
    def world(self) -> int:
        return self._world.world

    def all_reduce(self, buffer: np.ndarray, timeout: float | None) -> None:
        self._world._sum(self.rank, buffer, timeout)
