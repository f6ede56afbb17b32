"""The guide's runnable blocks: fenced code whose first line names the file it is."""

from __future__ import annotations

import re
from pathlib import Path


def extract_guide_files(guide: Path, into: Path, *, marker: str = "# file:") -> list[Path]:
    """Write every fenced block whose first line is ``MARKER PATH`` to ``into/PATH``."""
    written = []
    for block in re.findall(r"^```[\w-]*\n(.*?)^```", guide.read_text(), re.S | re.M):
        first, _, body = block.partition("\n")
        match = re.fullmatch(re.escape(marker) + r" (\S+)", first.strip())
        if match:
            path = into / match.group(1)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(body)
            written.append(path)
    return written
