"""docs/architecture.md's "Where to find things" names files that exist, and answers each round
path, each trait and each kind (issue 33).

A path in the section's tables is a backticked token with a ``/`` or a ``.py`` ending. It is
found from the repository's root, from ``meshkit/``, or -- as the tables write a row's later
files -- from the folder of a path named before it in the same row (``meshkit/wire/_channel.py``,
then ``wire/_keys.py``; ``meshkit/train/_rounds/``, then ``engine.py``). A ``<placeholder>`` path
(``plugins/meshkit_aggregators/<rule>.py``) stands for many and is not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from meshkit.components import KINDS
from meshkit.train._rounds.engine import ROUND_PATHS

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


def _section() -> str:
    text = DOC.read_text()
    start = text.index("## Where to find things")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def _rows() -> list[str]:
    return [line for line in _section().splitlines() if line.startswith("|")]


def _is_path(token: str) -> bool:
    return ("/" in token or token.endswith(".py")) and " " not in token and "<" not in token \
        and not token.startswith(("http", "-"))


def _named_paths() -> list[tuple[str, list[Path]]]:
    """Each path named in the section, with the folders it may be relative to."""
    named = []
    for row in _rows():
        folders: list[Path] = []
        for token in re.findall(r"`([^`]+)`", row):
            bases = [ROOT, ROOT / "meshkit", *folders]
            if "<" in token and "/" in token:  # not checked, but its folder is
                token = token[:token.index("<")]
            elif not _is_path(token):
                continue
            else:
                named.append((token, bases))
            for base in bases:
                found = base / token
                if found.exists():
                    folder = found if found.is_dir() else found.parent
                    # A later file may be beside this one or beside any folder above it.
                    folders = [f for f in (folder, *folder.parents)
                               if f == ROOT or ROOT in f.parents] + folders
                    break
    return named


def test_the_section_names_paths():
    assert len(_named_paths()) > 50  # the parser reads the tables at all


@pytest.mark.parametrize("path,bases", _named_paths(), ids=lambda v: v if isinstance(v, str)
                         else "")
def test_every_path_the_section_names_exists(path, bases):
    assert any((base / path).exists() for base in bases), (
        f"docs/architecture.md names `{path}`, which is not in the tree (looked in "
        f"{', '.join(str(b.relative_to(ROOT)) or '.' for b in bases[:4])})")


def _rows() -> list[str]:
    return [line for line in _section().splitlines() if line.startswith("|")]


#: Each round path's module (the flat round is the engine's own).
PATH_MODULES = {"collective": "collective.py", "relayed": "relayed.py", "batched": "batched.py",
                "compressed batched": "compressed.py", "flat": "engine.py", "secure": "secure.py"}


def test_every_round_path_has_a_module():
    assert {p.name for p in ROUND_PATHS} | {"secure"} == set(PATH_MODULES)


@pytest.mark.parametrize("name", sorted(PATH_MODULES))
def test_every_round_path_has_its_file(name):
    """A row asks about the ``name`` round in its question and answers with its module."""
    rows = [r for r in _rows() if f"{name} round" in r.split("|")[1]
            and f"meshkit/train/_rounds/{PATH_MODULES[name]}" in r.split("|")[2]]
    assert rows, f"no row of docs/architecture.md asks about the {name} round and answers " \
                 f"with meshkit/train/_rounds/{PATH_MODULES[name]}"


@pytest.mark.parametrize("trait", ["AggregatorTraits", "StrategyTraits", "CompressionTraits",
                                   "SecureAggregationTraits"])
def test_every_trait_has_its_file(trait):
    assert any(f"`{trait}`" in r for r in _rows()), f"docs/architecture.md never names {trait}"


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_has_its_contract_file(kind):
    row = next(r for r in _rows() if "the contract each component kind" in r)
    assert re.search(rf"`{kind}`: `[^`]+\.py`", row), (
        f"docs/architecture.md's kinds row does not name the {kind} kind's contract file")
