"""Fixtures of the wire tests."""

from __future__ import annotations

import pytest

from tests.support.channels import channel_pair


@pytest.fixture
def pair():
    a, b = channel_pair()
    yield a, b
    a.close()
    b.close()
