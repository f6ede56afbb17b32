"""docs/protocol.md's message tables, read the way a test compares them with the schemas."""

from __future__ import annotations

import re
from pathlib import Path

PROTOCOL = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"

#: One table row: (field, type, required, meaning), as ``field_table`` gives it.
Row = tuple[str, ...]


def documented_tables(start: str, end: str, heading: str) -> dict[tuple[str, str], list[Row]]:
    """The tables between the lines ``start`` and ``end``, each under a heading ``heading`` matches.

    ``heading`` is a regular expression with two groups (the op, and which
    message of it: ``request``, ``reply``, ``answer``); the result maps
    (op, which) -> its rows of (field, type, required, meaning).
    """
    text = PROTOCOL.read_text()
    section = text[text.index(start):text.index(end)]
    tables: dict[tuple[str, str], list[Row]] = {}
    current = None
    for line in section.splitlines():
        found = re.fullmatch(heading, line.strip())
        if found:
            current = (found.group(1), found.group(2))
            tables[current] = []
        elif current and line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            tables[current].append((cells[0].strip("`"), *cells[1:]))
    return tables
