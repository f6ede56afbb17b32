"""The spill: the coordinator's global model and outer-optimizer state in mapped files.

With ``[run] spill = true`` (issue 39) the coordinator keeps the global model
and the outer optimizer's moments in safetensors files in ``[run] spill_dir``
(default ``OUT/spill``, beside the checkpoint) and holds them as
``numpy.memmap`` arrays over those files, so its *resident* memory does not
count them: only the round's running sum (one model) is anonymous memory.

* ``global.safetensors`` -- each new global model is written to a fresh file
  (atomically, through the page cache, never through a mapping) and mapped
  back read-only; the state handed to the round is those maps.
* ``outer.safetensors`` -- the outer optimizer's arrays (``state_dict()``),
  mapped read-write: the built-in optimizers step their moments in place in
  the file (:func:`meshkit.outer.split_buffers` adopts a map instead of
  copying it). An optimizer whose ``load_state_dict`` copies what it is
  given keeps its state in memory, as without the spill.

Reading a mapped array (sending the model, evaluating it, writing the
checkpoint) faults its pages into this process, and Linux counts mapped file
pages in the resident set until they are unmapped. A pager thread therefore
drops every live map's pages (``madvise(MADV_DONTNEED)``) every
:data:`PAGER_INTERVAL` seconds: the pages stay in the page cache (shared,
reclaimable memory, counted in ``buff/cache``, not in the process), a
later read faults them back from there, and a written page of a shared map
keeps its data (the kernel marks the page-cache page dirty and writes it back).

The spill directory is scratch, not the checkpoint: ``checkpoint.npz`` is
still written every round, and ``--resume`` reads only that, so a resumed
run continues bit for bit whether or not either run spilled.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import threading
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np

from meshkit.errors import ConfigError
from meshkit.safetensors import DTYPES, write_safetensors

__all__ = ["GLOBAL_FILE", "OUTER_FILE", "PAGER_INTERVAL", "Spill", "check_spill", "spill_dir"]

#: Seconds between two passes of the pager (the resident pages a read can add in between
#: are what the process reads in that time: tens of MB at memory speed).
PAGER_INTERVAL = 0.01
GLOBAL_FILE = "global.safetensors"
OUTER_FILE = "outer.safetensors"


def spill_dir(out: str | os.PathLike[str], configured: str = "") -> Path:
    """``[run] spill_dir``, or ``OUT/spill`` when it is empty."""
    return Path(configured) if configured else Path(out) / "spill"


def check_spill(directory: Path, where: str) -> None:
    """Refuse a spill directory that cannot be created or written (a :class:`ConfigError`).

    ``where`` names the config key (``"run.toml: [run] spill_dir"``).
    """
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{where}: {str(directory)!r} is a file, not a directory; choose "
                          f"another spill_dir (or set spill = false)")
    probe = directory.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{where}: {str(probe)!r} is not a directory this user can write "
                          f"to, so the spill files cannot be written there; choose a writable "
                          f"spill_dir (or set spill = false)")


class Spill:
    """The spill directory of one run: writes, maps and pages out its files."""

    def __init__(self, directory: str | os.PathLike[str],
                 interval: float = PAGER_INTERVAL) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.interval = interval
        self._maps: list[weakref.ref[np.memmap]] = []
        self._lock = threading.Lock()
        self._pager: threading.Thread | None = None
        #: Set after each pass of the pager (what a test waits on, not a sleep).
        self.paged = threading.Event()
        self._closed = threading.Event()

    # -- the global model ----------------------------------------------------------

    def global_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """``state`` with its arrays in ``global.safetensors``, as read-only maps.

        A state whose arrays are all this spill's maps already is returned as it
        is (nothing rewritten). JSON values, and arrays of a dtype safetensors
        cannot hold, stay in memory.
        """
        arrays = _spillable(state)
        if all(self.owns(v) for v in arrays.values()):
            return dict(state)
        mapped = self._write(self.directory / GLOBAL_FILE, arrays, mode="r")
        return {k: mapped.get(k, v) for k, v in state.items()}

    # -- the outer optimizer's state --------------------------------------------------

    def adopt_outer(self, optimizer: Any) -> None:
        """Move ``optimizer``'s arrays into ``outer.safetensors``, mapped read-write.

        Once its ``load_state_dict`` has adopted the maps, later calls only see
        its state is spilled already and write nothing.
        """
        if optimizer is None:
            return
        state = optimizer.state_dict()
        arrays = _spillable(state)
        if not arrays or all(self.owns(v) and getattr(v, "mode", "") == "r+"
                              for v in arrays.values()):
            return
        mapped = self._write(self.directory / OUTER_FILE, arrays, mode="r+")
        optimizer.load_state_dict({k: mapped.get(k, v) for k, v in state.items()})

    # -- paging ------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the pager (the run is over); the maps stay readable, their pages counted
        again as they are read. Writing through this spill starts it again."""
        self._closed.set()
        if self._pager is not None:
            self._pager.join(5 * self.interval + 1.0)
            self._pager = None

    def owns(self, value: Any) -> bool:
        """Whether ``value`` is one of this spill's live maps."""
        if not isinstance(value, np.memmap):
            return False
        with self._lock:
            return any(ref() is value for ref in self._maps)

    def release(self) -> int:
        """Drop every live map's pages from this process's resident set; returns the maps."""
        with self._lock:
            self._maps = [ref for ref in self._maps if ref() is not None]
            live = [ref() for ref in self._maps]
        dropped = 0
        for array in live:
            handle = getattr(array, "_mmap", None)
            if handle is None:
                continue
            try:
                handle.madvise(mmap.MADV_DONTNEED)
                dropped += 1
            except (ValueError, OSError):  # closed meanwhile: nothing left to drop
                pass
        return dropped

    def _write(self, file: Path, arrays: Mapping[str, np.ndarray],
               mode: Literal["r", "r+"]) -> dict[str, np.ndarray]:
        write_safetensors(file, arrays)
        mapped = _map(file, mode)
        with self._lock:
            self._maps.extend(weakref.ref(a) for a in mapped.values()
                              if isinstance(a, np.memmap))
        self._start_pager()
        self.release()
        return mapped

    def _start_pager(self) -> None:
        if self._pager is not None:
            return
        self._closed.clear()
        # The thread holds the spill weakly: it ends at close() or once the spill is dropped.
        me = weakref.ref(self)
        interval, stop = self.interval, self._closed

        def page() -> None:
            while not stop.wait(interval):
                spill = me()
                if spill is None:
                    return
                spill.release()
                spill.paged.set()
                del spill

        self._pager = threading.Thread(target=page, name="meshkit-spill-pager", daemon=True)
        self._pager.start()


def _spillable(state: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The arrays of ``state`` a safetensors file holds (non-empty, native byte order)."""
    return {k: v for k, v in state.items()
            if isinstance(v, np.ndarray) and v.size and v.dtype in DTYPES
            and v.dtype.isnative}


def _map(file: Path, mode: Literal["r", "r+"]) -> dict[str, np.ndarray]:
    """Every tensor of the safetensors ``file`` as a ``numpy.memmap`` (``mode`` "r" or "r+")."""
    with open(file, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    header.pop("__metadata__", None)
    by_name = {name: dtype for dtype, name in DTYPES.items()}
    base = 8 + length
    out: dict[str, np.ndarray] = {}
    for name, entry in header.items():
        begin, _ = entry["data_offsets"]
        shape = tuple(entry["shape"])
        # A 0-d tensor is mapped as one element and viewed back as 0-d (still a memmap).
        array = np.memmap(file, dtype=by_name[entry["dtype"]], mode=mode, offset=base + begin,
                          shape=shape or (1,))
        out[name] = array if shape else array.reshape(())
    return out
