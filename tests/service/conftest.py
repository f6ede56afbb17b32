"""Fixtures for the service tests: a federation of real processes, and run configs."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tests.support.service import Federation


@pytest.fixture
def federation(tmp_path: Path) -> Iterator[Federation]:
    fed = Federation(tmp_path)
    try:
        yield fed
    finally:
        fed.close()
