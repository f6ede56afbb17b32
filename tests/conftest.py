"""Fixtures every test directory shares (helpers are in ``tests/support``)."""

from __future__ import annotations

import pytest

import meshkit.plugins

from tests.support.cli import FIXTURES, pip_install_target


@pytest.fixture(scope="session")
def hello_site(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A directory holding the installed third-party fixture package meshkit-hello."""
    target = tmp_path_factory.mktemp("hello-site")
    pip_install_target(target, FIXTURES / "meshkit-hello")
    return str(target)


@pytest.fixture(autouse=True)
def _fresh_default_plugins():
    """No test sees another's default plugin set."""
    meshkit.plugins.reset()
    yield
    meshkit.plugins.reset()


