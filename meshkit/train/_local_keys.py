"""Keys that stay on each client (FedBN): which keys they are, and where each client's are kept.

``[strategy] local_keys = [...]`` names state keys that are never
aggregated: each client trains them from its own last values, and the global
model never takes them from anyone. FedBN (Li et al., *FedBN: Federated
Learning on Non-IID Features via Local Batch Normalization*, ICLR 2021)
keeps the normalisation layers local this way; ``meshkit.torch`` offers
them as the group ``"@norm"``.

Where a client's values live: on the coordinator, per client
(:class:`ClientLocal`), checkpointed with the run. Not on the node: a
client is served by whichever live worker the round engine hands it to,
and a worker that restarts has lost its memory; the coordinator is the one
place that sees every client's fit and writes the checkpoint ``--resume``
reads. What it holds is the clients that have fitted times the size of the
local keys (two vectors per normalisation layer for FedBN), packed into one
record per client and moved to a file in the run directory past
:data:`MEMORY_BYTES`; each client's values travel with its fit request
(``local``).
"""

from __future__ import annotations

import fnmatch
import logging
from pathlib import Path
from typing import Any, Iterable, Mapping

import attrs
import numpy as np

from meshkit.compression import is_residual
from meshkit.errors import ConfigError, StateError
from meshkit.state import is_array
from meshkit.task import key_groups

__all__ = ["resolve_local_keys", "ClientLocal", "MEMORY_BYTES"]

log = logging.getLogger(__name__)


def resolve_local_keys(patterns: Iterable[str], state: Mapping[str, Any], task: Any, *,
                       where: str = "[strategy] local_keys") -> frozenset[str]:
    """The state's array keys ``patterns`` name: globs (``fnmatch``) or ``"@group"``.

    A group is one the task offers (``task.key_groups()``; ``meshkit.torch``:
    ``"norm"``). An unknown group, or a pattern that names no array of the
    model, is a :class:`ConfigError`: an option that keeps nothing local
    would silently be plain FedAvg.
    """
    arrays = [k for k, v in state.items() if is_array(v)]
    groups = key_groups(task)
    chosen: set[str] = set()
    for pattern in patterns:
        if pattern.startswith("@"):
            name = pattern[1:]
            if name not in groups:
                offered = ", ".join(f'"@{g}"' for g in sorted(groups)) or "none"
                raise ConfigError(
                    f"{where}: {pattern!r} names a key group the task "
                    f"({type(task).__name__}) does not offer (it offers: {offered}); use a "
                    f"glob of state keys such as \"bn*\" instead")
            found = [k for k in arrays if k in groups[name]]
        else:
            found = [k for k in arrays if fnmatch.fnmatchcase(k, pattern)]
        if not found:
            shown = ", ".join(map(repr, arrays[:6])) + (", ..." if len(arrays) > 6 else "")
            raise ConfigError(
                f"{where}: {pattern!r} matches no array of the model (its keys: {shown}); "
                f"fix the pattern, or drop it")
        chosen.update(found)
    return frozenset(chosen)


#: Bytes of per-client values a run holds in memory; past this they live in a
#: file in the run directory (``client_local.bin``), read and written per client.
MEMORY_BYTES = 256 * 2**20
#: The file a run's per-client values spill to.
SPILL_NAME = "client_local.bin"


@attrs.define
class ClientLocal:
    """Each client's own values of the local keys, on the coordinator, stored compactly.

    ``keys`` are the local keys (empty: nothing is kept local). A client
    that has not fitted yet has no values: its first fit starts from the
    global model's.

    Storage: every client's values are one fixed-size record (the local
    keys' bytes, in key order; the layout is fixed by the first client kept),
    so the run holds ``clients x record`` bytes and an index of 8 bytes per
    client number, not a mapping of small arrays. Past ``memory_bytes`` the
    records move to ``spill_dir / client_local.bin`` (the runner gives its
    run directory) and are read and written one client at a time, so the
    coordinator's memory stays bounded however many clients a run reaches;
    the page cache, not the process, holds what is hot. Without a
    ``spill_dir`` the records stay in memory.
    """

    keys: frozenset[str] = frozenset()
    spill_dir: Path | None = None
    memory_bytes: int = MEMORY_BYTES
    _layout: tuple[tuple[str, np.dtype, tuple[int, ...]], ...] = ()
    _index: np.ndarray = attrs.field(factory=lambda: np.full(0, -1, np.int64))
    _records: np.ndarray = attrs.field(factory=lambda: np.zeros((0, 0), np.uint8))
    _slots: int = 0

    def __bool__(self) -> bool:
        return bool(self.keys)

    @property
    def clients(self) -> int:
        """How many clients have values kept."""
        return self._slots

    @property
    def spilled(self) -> bool:
        """Whether the records live in the run directory's file rather than in memory."""
        return isinstance(self._records, np.memmap)

    def of(self, client: int) -> dict[str, np.ndarray]:
        """The client's values (``{}`` before its first fit)."""
        if not 0 <= client < len(self._index) or self._index[client] < 0:
            return {}
        record = self._records[int(self._index[client])]
        out, at = {}, 0
        for key, dtype, shape in self._layout:
            size = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
            out[key] = np.frombuffer(record[at:at + size].tobytes(), dtype=dtype).reshape(shape)
            at += size
        return out

    def keep(self, client: int, state: Mapping[str, Any]) -> dict[str, Any]:
        """Keep the client's local keys from its fitted ``state``; the rest is what is folded."""
        if not self.keys:
            return dict(state)
        missing = sorted(self.keys - set(state))
        if missing:
            raise StateError(f"client {client}'s model lacks its local keys "
                             f"{', '.join(map(repr, missing))}")
        values = {k: np.asarray(state[k]) for k in sorted(self.keys)}
        if not self._layout:
            self._layout = tuple((k, v.dtype, tuple(v.shape)) for k, v in values.items())
        for key, dtype, shape in self._layout:
            if values[key].dtype != dtype or values[key].shape != shape:
                raise StateError(
                    f"client {client}'s local key {key!r} is {values[key].dtype}"
                    f"{list(values[key].shape)}, but the run keeps it as {dtype}{list(shape)}")
        slot = self._slot(client)
        record = b"".join(np.ascontiguousarray(values[key]).tobytes()
                          for key, _, _ in self._layout)
        self._records[slot] = np.frombuffer(record, np.uint8)
        return {k: v for k, v in state.items() if k not in self.keys}

    def _record_bytes(self) -> int:
        return sum(d.itemsize * int(np.prod(s, dtype=np.int64)) for _, d, s in self._layout)

    def _slot(self, client: int) -> int:
        """The client's record number, a new one on its first keep."""
        if client < 0:
            raise StateError(f"client numbers are >= 0, got {client}")
        if client >= len(self._index):
            grown = np.full(max(client + 1, 2 * len(self._index), 64), -1, np.int64)
            grown[:len(self._index)] = self._index
            self._index = grown
        if self._index[client] >= 0:
            return int(self._index[client])
        slot = self._slots
        if slot >= len(self._records):
            self._reserve(max(64, 2 * len(self._records)))
        self._index[client] = slot
        self._slots += 1
        return slot

    def _reserve(self, capacity: int) -> None:
        """Room for ``capacity`` records: in memory under the bound, else in the spill file."""
        record = self._record_bytes()
        old = self._records
        if self.spill_dir is None or capacity * record <= self.memory_bytes:
            grown = np.zeros((capacity, record), np.uint8)
            if self._slots:
                grown[:self._slots] = old[:self._slots]
            self._records = grown
            return
        path = Path(self.spill_dir) / SPILL_NAME
        if isinstance(old, np.memmap):
            old.flush()
            with open(path, "r+b") as fh:
                fh.truncate(capacity * record)  # sparse: only what is written takes disk
            self._records = np.memmap(path, np.uint8, "r+", shape=(capacity, record))
            return
        log.info("client-local values of %d clients exceed %d bytes: keeping them in %s",
                 self._slots, self.memory_bytes, path)
        spilled = np.memmap(path, np.uint8, "w+", shape=(capacity, record))
        if self._slots:
            spilled[:self._slots] = old[:self._slots]
        self._records = spilled

    def state_dict(self) -> dict[str, Any]:
        """What the checkpoint keeps: the layout, the index and the records (two arrays).

        ``records`` may be the spill file's map: the checkpoint writer
        streams it, it is not read into memory at once.
        """
        if not self._slots:
            return {}
        last = int(np.flatnonzero(self._index >= 0)[-1]) + 1
        return {"layout": [[k, d.str, list(s)] for k, d, s in self._layout],
                "index": self._index[:last].copy(), "records": self._records[:self._slots]}

    def use(self, keys: frozenset[str]) -> None:
        """Set the run's local keys; values restored from a checkpoint must be theirs.

        A compressed run's residuals (error feedback) are kept here too, under
        names no model key has (:func:`meshkit.compression.residual_name`); they
        stay whatever the local keys are.
        """
        residuals = {k for k, _, _ in self._layout if is_residual(k)}
        keys = frozenset(keys | residuals)
        stale = sorted({k for k, _, _ in self._layout} - keys)
        if stale:
            raise StateError(
                f"the checkpoint keeps client-local values of {', '.join(map(repr, stale))}, "
                f"which [strategy] local_keys no longer names; resume with the same "
                f"local_keys, or start afresh with --overwrite")
        self.keys = keys

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (checked against the keys by :meth:`use`).

        Also reads the format before the records were packed: one entry
        ``"<client>/<key>"`` per client and key.
        """
        self._layout, self._slots = (), 0
        self._index = np.full(0, -1, np.int64)
        self._records = np.zeros((0, 0), np.uint8)
        if not state:
            return
        if set(state) == {"layout", "index", "records"}:
            self._load_packed(state)
            return
        values: dict[int, dict[str, np.ndarray]] = {}
        for flat, value in state.items():
            client, sep, key = flat.partition("/")
            if not sep or not client.isdigit() or not is_array(value):
                raise StateError(f"checkpoint: client-local entry {flat!r} is not "
                                 f"'<client>/<key>' holding an array")
            values.setdefault(int(client), {})[key] = np.asarray(value)
        keys = frozenset(k for table in values.values() for k in table)
        saved, self.keys = self.keys, keys
        try:
            for number in sorted(values):
                self.keep(number, values[number])
        finally:
            self.keys = saved

    def _load_packed(self, state: Mapping[str, Any]) -> None:
        try:
            layout = tuple((str(k), np.dtype(d), tuple(int(n) for n in s))
                           for k, d, s in state["layout"])
            index = np.asarray(state["index"], dtype=np.int64)
            records = np.asarray(state["records"], dtype=np.uint8)
        except (TypeError, ValueError) as exc:
            raise StateError(f"checkpoint: the client-local values are not a layout, an "
                             f"index and records ({exc})") from None
        self._layout = layout
        slots = int(records.shape[0]) if records.ndim == 2 else -1
        if (records.ndim != 2 or records.shape[1] != self._record_bytes()
                or index.ndim != 1 or int((index >= 0).sum()) != slots
                or (slots and int(index.max()) >= slots)):
            raise StateError("checkpoint: the client-local records do not match their "
                             "layout and index; start afresh with --overwrite")
        self._index = index.copy()
        self._records = np.zeros((0, self._record_bytes()), np.uint8)
        self._reserve(max(slots, 1))
        self._records[:slots] = records
        self._slots = slots
