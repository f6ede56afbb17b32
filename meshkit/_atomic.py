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
from typing import BinaryIO, Iterator

__all__ = ["atomic_file", "fsync_directory"]


@contextlib.contextmanager
def atomic_file(target: str | os.PathLike[str], *, durable: bool = False,
                prefix: str | None = None, suffix: str = ".tmp") -> Iterator[BinaryIO]:
    """A binary file to write that becomes ``target`` when the ``with`` block ends.

    The temporary is ``prefix + random + suffix`` in ``target``'s directory
    (``prefix`` defaults to ``"." + target's name + "-"``).
    """
    # Plain os.path on a str: a checkpoint is written every round, and pathlib's
    # parsing and mkdir(exist_ok=True) (an OSError raised and caught when the
    # directory is there) were a few hundred lines of Python a save (issue 36).
    path = os.fspath(target)
    parent, name = os.path.split(path)
    parent = parent or os.curdir
    if not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-" if prefix is None else prefix,
                               suffix=suffix, dir=parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_directory(parent)


def fsync_directory(directory: str | os.PathLike[str]) -> None:
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
