"""Error feedback's residuals kept where the client trains (``[compression] residual = "worker"``).

Rule: a worker's own clients' residuals live here, and never leave the process.

The coordinator pins each client to one worker (:mod:`meshkit.train._rounds.pins`)
and names, in each fit request, the seed of the client's last *folded* fit
(``compress.residual.from``). The worker feeds back the residual that fit left,
and keeps the one this fit leaves under this fit's seed. So it keeps up to two
generations a client: the one named (a fit played again -- a round replayed, a
reply lost -- must start from it again) and the newest (the next round's, once
the coordinator says it was folded). A fit naming a generation this worker does
not hold (a restarted process, a client moved here) starts from zero, and the
worker says so in its log.

Storage is the coordinator's client-local store's (:class:`meshkit.train.ClientLocal`:
one packed record a generation, client ``c``'s in records ``2c`` and ``2c + 1``),
past :data:`MEMORY_BYTES` in a file in a directory this worker made for itself
(``meshkit-residuals-*`` in the system's temporary directory), removed when the
worker exits.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Mapping

import numpy as np

from meshkit.compression import RESIDUAL, SEP
from meshkit.train._local_keys import ClientLocal

__all__ = ["WorkerResiduals", "MEMORY_BYTES"]

log = logging.getLogger(__name__)

#: Bytes of residuals a worker keeps in memory; past this they live in its spill file.
MEMORY_BYTES = 256 * 2**20


class WorkerResiduals:
    """Each client's residual generations on this worker (module docstring)."""

    def __init__(self, memory_bytes: int = MEMORY_BYTES) -> None:
        self.memory_bytes = int(memory_bytes)
        self._store: ClientLocal | None = None
        #: client -> the fit seed each of its two records holds (None: empty).
        self._tags: dict[int, list[int | None]] = {}
        #: Fits that named a generation this worker did not hold (started from zero).
        self.missing = 0
        self._dir: Path | None = None

    @property
    def spilled(self) -> bool:
        return self._store is not None and self._store.spilled

    def take(self, client: int, after: int | None) -> dict[str, np.ndarray]:
        """The residual (model key -> float32) the fit after the one seeded ``after`` feeds
        back; {} for none (``after`` None, or a generation this worker does not hold)."""
        if after is None:
            return {}
        tags = self._tags.get(client)
        if tags is None or after not in tags or self._store is None:
            self.missing += 1
            log.warning("client %d's residual (from its fit seeded %d) is not on this worker "
                        "(a restarted process?): its error feedback restarts from zero",
                        client, after)
            return {}
        values = self._store.of(2 * client + tags.index(after))
        cut = len(SEP + RESIDUAL)
        return {k[:-cut]: v for k, v in values.items()}

    def keep(self, client: int, seed: int, after: int | None,
             residuals: Mapping[str, np.ndarray]) -> None:
        """Keep what the fit seeded ``seed`` (fed from ``after``) left, by residual name,
        never over the generation it was fed from."""
        if not residuals:
            return
        if self._store is None:
            self._dir = Path(tempfile.mkdtemp(prefix="meshkit-residuals-"))
            weakref.finalize(self, shutil.rmtree, self._dir, True)
            self._store = ClientLocal(frozenset(residuals), spill_dir=self._dir,
                                      memory_bytes=self.memory_bytes)
        tags = self._tags.setdefault(client, [None, None])
        if seed in tags:
            slot = tags.index(seed)  # the same fit again
        else:
            slot = 1 if after is not None and tags[0] == after else 0
        self._store.keep(2 * client + slot, residuals)
        tags[slot] = seed
