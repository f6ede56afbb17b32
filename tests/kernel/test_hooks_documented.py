"""Every hook spec has a docstring and a docs/hooks.md section with its exact signature."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from meshkit import hookspecs

DOC = (Path(__file__).resolve().parents[2] / "docs" / "hooks.md").read_text()
SPECS = sorted(n for n in dir(hookspecs) if n.startswith("meshkit_"))


def _documented_signature(name: str) -> str:
    section = re.search(rf"^### {name}\n\n```python\n(.*?)\n```", DOC, re.S | re.M)
    assert section, f"docs/hooks.md has no '### {name}' section with a signature block"
    return section.group(1).strip()


@pytest.mark.parametrize("name", SPECS)
def test_each_hook_is_documented_with_its_exact_signature(name):
    spec = getattr(hookspecs, name)
    assert spec.__doc__ and "alled" in spec.__doc__, f"{name} must say when it is called"
    actual = f"def {name}{inspect.signature(spec)}".replace("'", "")
    assert _documented_signature(name) == actual


def test_docs_document_no_hook_that_does_not_exist():
    documented = set(re.findall(r"^### (meshkit_\w+)$", DOC, re.M))
    assert documented == set(SPECS)
