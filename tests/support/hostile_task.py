"""A ``digits`` task one node runs hostile: each round it misbehaves as ``misbehave`` says.

Started on one ``meshkit node`` with ``--task-option misbehave=nan+scalar+shape``
(the other nodes and the coordinator run it honest, ``misbehave = ""``): in
its n-th round the node's fits do the n-th thing of the list. A round is told
by the model a fit starts from (a new global model, a new round), so the
node needs no word from the coordinator. What each mode sends:

* ``error`` -- the fit raises: an ``error`` reply.
* ``nan`` / ``inf`` -- one element of ``hidden.w`` is NaN / inf.
* ``huge`` -- every element of ``hidden.w`` is 1e308 (finite).
* ``scalar`` -- ``hidden.w`` is a 0-d array where the model has a matrix.
* ``shape`` -- ``hidden.w`` has one row too many.
* ``hang`` -- the fit sleeps (60 s) before it answers: a stall.
* ``honest`` -- nothing: an honest fit.

``fit:MODES`` counts fits instead of rounds: the node's n-th fit does the
n-th thing (for ``fedbuff``, where a node may fit twice from one model).

A run whose workers are spawned for it (``launch = "local"``, host relays,
torchrun) cannot give one node its own option: there the test sets
``MESHKIT_TEST_MISBEHAVE = "RANK:MODES"`` and only the ``meshkit node``
process started with ``--rank RANK`` (or torchrun's rank RANK) takes MODES
(the coordinator, relays and other ranks stay honest).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Mapping

import attrs
import numpy as np

from meshkit_tasks.digits import DigitsTask
from meshkit_tasks.options import DigitsOptions

MODES = ("error", "nan", "inf", "huge", "scalar", "shape", "hang", "honest")


@attrs.frozen
class HostileOptions(DigitsOptions):
    #: The modes of this node's rounds, joined by "+" (module docstring); "" honest.
    misbehave: str = ""


def _modes_from_env() -> str:
    """MODES of ``MESHKIT_TEST_MISBEHAVE = "RANK:MODES"`` in the process of rank RANK: a
    ``meshkit node --rank RANK``, or torchrun's rank RANK of ``-m meshkit_torchdist``."""
    rank, _, modes = os.environ.get("MESHKIT_TEST_MISBEHAVE", "").partition(":")
    argv = sys.argv
    if "node" in argv and "--rank" in argv:
        mine = argv[argv.index("--rank") + 1]
    elif argv and "meshkit_torchdist" in argv[0]:
        mine = os.environ.get("RANK", "")
    else:
        return ""
    return modes if rank and mine == rank else ""


class Hostile(DigitsTask):
    Options = HostileOptions

    def __init__(self, options: HostileOptions | None = None) -> None:
        super().__init__(options or HostileOptions())
        spec = self.options.misbehave or _modes_from_env()
        self.per_fit = spec.startswith("fit:")
        self.modes = [m for m in spec.removeprefix("fit:").split("+") if m]
        unknown = sorted(set(self.modes) - set(MODES))
        if unknown:
            raise ValueError(f"misbehave: unknown modes {unknown}; known: {MODES}")
        self._last: bytes | None = None
        self._round = 0

    def fit(self, state: Mapping[str, Any], x: np.ndarray, y: np.ndarray, *, seed: int,
            time_budget: float | None = None) -> Any:
        start = np.asarray(state["hidden.w"]).tobytes()
        if start != self._last or self.per_fit:
            self._last, self._round = start, self._round + 1
        mode = self.modes[self._round - 1] if self._round <= len(self.modes) else "honest"
        if mode == "error":
            raise RuntimeError("hostile node: this fit refuses")
        if mode == "hang":
            time.sleep(60)
        result = super().fit(state, x, y, seed=seed, time_budget=time_budget)
        fitted = dict(result.state)
        w = fitted["hidden.w"]
        if mode == "nan":
            w[0, 0] = np.nan
        elif mode == "inf":
            w[0, 0] = np.inf
        elif mode == "huge":
            w[...] = 1e308
        elif mode == "scalar":
            fitted["hidden.w"] = np.array(0.5, w.dtype)
        elif mode == "shape":
            fitted["hidden.w"] = np.zeros((w.shape[0] + 1, w.shape[1]), w.dtype)
        return attrs.evolve(result, state=fitted)


@attrs.frozen
class BrokenShardOptions(DigitsOptions):
    #: The client (shard ``broken`` of ``shards``, contiguous) whose every fit raises; -1: none.
    broken: int = -1
    shards: int = 1


class BrokenShard(DigitsTask):
    """``digits`` whose fit of one client raises, on any rank (a client's deterministic bug)."""

    Options = BrokenShardOptions

    def __init__(self, options: BrokenShardOptions | None = None) -> None:
        super().__init__(options or BrokenShardOptions())

    def fit(self, state: Mapping[str, Any], x: np.ndarray, y: np.ndarray, *, seed: int,
            time_budget: float | None = None) -> Any:
        from meshkit.train import shard_bounds

        opts = self.options
        if opts.broken >= 0:
            train_x = self.train_data()[0]
            start, end = shard_bounds(len(train_x), opts.shards)[opts.broken]
            if len(x) == end - start and np.array_equal(x, train_x[start:end]):
                raise RuntimeError(f"client {opts.broken}'s data breaks this fit")
        return super().fit(state, x, y, seed=seed, time_budget=time_budget)
