"""Writing a file atomically: readers see the old file or the whole new one, never part.

The bytes go to a temporary file beside the target, which replaces it
(``os.replace``) only once the block that writes it ends without an error;
an error removes the temporary and propagates. ``durable=True`` also
fsyncs the file and its directory, so the new file survives a power cut.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Iterator

__all__ = ["atomic_file", "fsync_directory"]


@contextlib.contextmanager
def atomic_file(target: Path, *, durable: bool = False, prefix: str | None = None,
                suffix: str = ".tmp") -> Iterator[BinaryIO]:
    """A binary file to write that becomes ``target`` when the ``with`` block ends.

    The temporary is ``prefix + random + suffix`` in ``target``'s directory
    (``prefix`` defaults to ``"." + target.name + "-"``).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}-" if prefix is None else prefix,
                               suffix=suffix, dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        fsync_directory(target.parent)


def fsync_directory(directory: Path) -> None:
    """Flush ``directory``'s entries (a rename is durable only once they are on disk)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # not every file system can sync a directory; the rename stands
    finally:
        os.close(fd)
