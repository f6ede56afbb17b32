"""Fixtures of the node tests: the in-process mesh."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.inproc_mesh import Mesh


@pytest.fixture
def mesh_factory():
    made: list[Mesh] = []

    def make(nodes: dict[int, dict[str, Any]], **kw: Any) -> Mesh:
        mesh = Mesh(nodes, **kw)
        made.append(mesh)
        return mesh

    yield make
    for mesh in made:
        mesh.close()
