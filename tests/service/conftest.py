"""Fixtures for the service tests: a federation of real processes, and run configs."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tests.support.service import Federation

# A service test runs a whole federation of processes (the service, four
# nodes, runs, sometimes a kill -9 and a restart); each wait inside has its
# own deadline (tests/support/service.py), so the suite-wide 120 s hang guard
# only has to catch a hang, not bound a loaded machine: under load 30 on two
# cores one such test took longer than 120 s while every step progressed.
SERVICE_TIMEOUT = 900


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.timeout(SERVICE_TIMEOUT))


@pytest.fixture
def federation(tmp_path: Path) -> Iterator[Federation]:
    fed = Federation(tmp_path)
    try:
        yield fed
    finally:
        fed.close()
