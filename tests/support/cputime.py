"""Where a test run's CPU goes: ``pytest -p tests.support.cputime`` (a measuring aid).

Appends one JSON line per test to ``$MESHKIT_CPUTIME`` (default
``cputime.jsonl`` in the working directory): its node id, wall seconds, the
CPU seconds of the test process itself (``self``, every thread) and of the
processes it started and waited for (``children``: a ``meshkit run`` and the
workers it reaped count there), the xdist worker and when it ended. On a
shared machine wall time measures the neighbours; CPU time measures the test.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Iterator

import pytest


def _cpu() -> tuple[float, float]:
    mine = resource.getrusage(resource.RUSAGE_SELF)
    waited = resource.getrusage(resource.RUSAGE_CHILDREN)
    return mine.ru_utime + mine.ru_stime, waited.ru_utime + waited.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    self0, children0 = _cpu()
    start = time.monotonic()
    yield
    self1, children1 = _cpu()
    line = {"id": item.nodeid, "wall": time.monotonic() - start, "self": self1 - self0,
            "children": children1 - children0,
            "worker": os.environ.get("PYTEST_XDIST_WORKER", ""), "t": time.time()}
    with open(os.environ.get("MESHKIT_CPUTIME", "cputime.jsonl"), "a") as out:
        out.write(json.dumps(line) + "\n")


def summary(path: str, top: int = 20) -> str:
    """The CPU seconds of a ``cputime.jsonl``: the total, then the ``top`` tests."""
    with open(path) as lines:
        rows = [json.loads(line) for line in lines]
    cpu = sorted(rows, key=lambda row: -(row["self"] + row["children"]))
    total = sum(row["self"] + row["children"] for row in rows)
    started = sum(row["children"] for row in rows)
    wall = sum(row["wall"] for row in rows)
    head = (f"{len(rows)} tests: {total:.0f} CPU-s ({started:.0f} in processes they started), "
            f"{wall:.0f} s of wall")
    out = [head]
    out += [f"{row['self'] + row['children']:7.1f} CPU-s {row['wall']:7.1f} s  {row['id']}"
            for row in cpu[:top]]
    return "\n".join(out)


if __name__ == "__main__":
    import sys

    print(summary(sys.argv[1] if len(sys.argv) > 1 else "cputime.jsonl"))
